"""``python -m sparsekv.bench.kernels``: the same as ``sparsekv bench kernels``."""

from sparsekv.bench.kernels.cli import main

raise SystemExit(main())
