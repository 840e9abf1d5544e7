"""``ocp.step``: step-directory name formats (``standard_name_format``, ``NameFormat``)."""

from cairn.checkpoint._step_names import NameFormat, StandardNameFormat, standard_name_format

__all__ = ["NameFormat", "StandardNameFormat", "standard_name_format"]
