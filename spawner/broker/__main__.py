"""``python -m spawner.broker``: run the broker service (JupyterHub starts it)."""

import asyncio

from spawner.broker.app import main

asyncio.run(main())
