"""``python -m gpu_magics.kernel``: the "Python 3 (GPUs)" kernel (kernels/python3-gpus/kernel.json)."""

from gpu_magics.kernel.launcher import main

main()
