"""User-facing errors: one line that names the cause and the fix, printed without a traceback."""


class ConfigError(ValueError):
    """A config or layout mistake the user can fix; the CLI prints it as one line and exits 2."""
