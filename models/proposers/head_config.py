"""The small JSON config a trained draft head keeps beside the model (medusa_config.json,
eagle_config.json)."""

import json
from pathlib import Path

from cluster_configs.errors import CheckpointError


def read_head_config(path: Path, missing: str) -> dict:
    """The config as a dict ({} if it is JSON but not an object); CheckpointError if it is missing (naming
    what it should hold: `missing`) or unreadable."""
    try:
        config = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing; {missing}") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: not readable JSON ({e})") from None
    return config if isinstance(config, dict) else {}
