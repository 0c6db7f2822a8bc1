"""The release: the one place its version is set (pyproject.toml reads it; scripts/release.py checks it).

Shown by `node-health --version`, in /status (`version`), in the image's OCI labels and tags. A config file may
say which release it was written for (`config_version`); a newer one makes the agent say so when it ignores a
key it does not know (agent/config.py).
"""

__version__ = "0.2.0"
