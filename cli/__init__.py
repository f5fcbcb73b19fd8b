"""The `ds4` command line: a typer app that parses, calls the `ds4` library and renders with rich.

Nothing imports `cli`; the console script is `cli.main:main`.
"""
