"""``python -m launcher`` is ``dtrain``."""

from launcher.cli.entry import run_main

if __name__ == "__main__":
    run_main()
