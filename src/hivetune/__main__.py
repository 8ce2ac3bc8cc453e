from hivetune.cli import entry

entry()
