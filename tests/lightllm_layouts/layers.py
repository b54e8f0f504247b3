"""How a LightLLM stand-in tree is put together: the directories each layout's tree is copied from,
later ones over earlier ones. ``main`` holds the modules main has and v1.0.x lacks
(``mode_backend/generic_post_process.py``), so the v1_0 tree never sees them."""

import os
import shutil

HERE = os.path.dirname(os.path.abspath(__file__))
LAYERS = {"main": ("common", "main"), "v1_0": ("common", "v1_0"), "v1_0_0": ("common", "v1_0", "v1_0_0"),
          "pr965": ("common", "pr965"),
          "unknown": ("common", "main", "unknown")}


def build_tree(layout: str, tree):
    """Copy the stand-in of ``layout`` into the directory ``tree`` (created if needed); returns ``tree``."""
    for layer in LAYERS[layout]:
        shutil.copytree(os.path.join(HERE, layer), tree, dirs_exist_ok=True)
    return tree
