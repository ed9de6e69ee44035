"""Run `sparsekv <args>` as on a CPU without native bf16 (engine_setup.has_native_bf16 -> False);
PREPACK=0 also turns the fp32 prepacking off."""
import os, sys
from sparsekv.engine import engine_setup
engine_setup.has_native_bf16 = lambda: False
if os.environ.get("PREPACK") == "0":
    engine_setup.can_prepack = lambda *a: False
from sparsekv.cli import main
sys.argv = ["sparsekv", *sys.argv[1:]]
sys.exit(main())
