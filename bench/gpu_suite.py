"""One-call GPU suite for issue 3: ``PYTHONPATH=src python3 bench/gpu_suite.py --out DIR [--tiny]``."""

from specpilot.bench.gpu_suite import main

if __name__ == "__main__":
    main()
