"""Claims ``scale weights`` too."""

from transformdsl.extend import Transform


class Rival(Transform):
    verb = "scale"
    mode = "weights"
