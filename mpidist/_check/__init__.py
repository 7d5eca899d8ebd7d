"""The checks that turn a wrong call into an error on every rank instead of a hang: the call's
signature, the mismatch check between ranks, init's argument check.
"""
