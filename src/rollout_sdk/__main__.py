from .launch.cli import entry

entry()
