"""The one exception type that reaches the user as a single line and exit code 2."""


class UserError(Exception):
    """Bad input from the user (a path, a file:line, a config key or value).

    The CLI prints ``hivetune: error: <message>`` and exits with code 2; the traceback is
    shown only with ``--debug``. Messages name the file and line, or the config key.
    """
