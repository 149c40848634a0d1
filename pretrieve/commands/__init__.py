"""The commands of `pretrieve` (cli.py), a module per group: each command's flags are defined in one function,
`add_<command>` (`prepare`: data.add_prepare), and run by its `run_<command>`; arguments.py holds what several
share."""
