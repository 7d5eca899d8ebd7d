"""From a public op to a backend: group and rank resolution, recording, checking, launching
(inline or on the group's engine), and the backend interface.
"""
