"""``python -m tagc.cost``: the cost model's command line (:mod:`tagc.cost.cli`)."""
from .cli import run

if __name__ == "__main__":
    run()
