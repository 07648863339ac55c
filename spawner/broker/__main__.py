"""``python -m spawner.broker``: run the broker service (JupyterHub starts it)."""

import asyncio

from .app import main

asyncio.run(main())
