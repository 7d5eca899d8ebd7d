"""Command-line tools: ``python -m mpidist.tools.trace DIR`` reads flight recorder dumps."""
