"""YAML loading for config files, with YAML 1.2's number syntax for floats.

PyYAML's ``safe_load`` follows YAML 1.1, whose float pattern needs a dot in the mantissa and a sign in the
exponent: ``25.0e+9`` is a float but ``25.0e9`` and ``1e9`` load as the *strings* ``"25.0e9"`` and ``"1e9"``, and
a typed config then refuses them (``Expected `float`, got `str```) although every other YAML 1.2 reader (Helm,
ruamel, JSON) reads a number. ``safe_load_yaml`` resolves scalars of the form ``[-+]?digits[.digits]e[-+]?digits``
and ``[-+]?.digits e[-+]?digits`` (no quotes) to floats too; everything else is ``yaml.safe_load`` unchanged
(integers, ``.inf`` / ``.nan``, quoted strings, ``1_000``).
"""

from __future__ import annotations

import re

import yaml

_FLOAT_1_2 = re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$")


class _SafeLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that also resolves YAML 1.2 exponent floats (``1e9``, ``25.0e9``) to ``float``."""


_SafeLoader.add_implicit_resolver("tag:yaml.org,2002:float", _FLOAT_1_2, list("-+0123456789."))


def safe_load_yaml(text: str) -> object:
    """Parse ``text`` as ``yaml.safe_load`` does, but read ``1e9`` / ``25.0e9`` as floats (YAML 1.2).

    Returns:
        the document: a mapping, sequence, scalar or ``None`` for an empty document.

    Raises:
        yaml.YAMLError: the text is not valid YAML.
    """
    return yaml.load(text, Loader=_SafeLoader)  # noqa: S506 - a SafeLoader subclass: no arbitrary objects
