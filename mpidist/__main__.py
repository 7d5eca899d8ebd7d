"""``python -m mpidist script.py | -m module | -c code [args]``: see :mod:`mpidist.run`."""

from mpidist.run import main

main()
