"""The process's state and the objects every op shares: the current runtime, tags, private files,
the flight recorder and the process group (with :mod:`mpidist.errors` and :mod:`mpidist.work`).
"""
