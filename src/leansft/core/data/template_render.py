"""Chat templates rendered as transformers renders them, without an exception per message field.

transformers compiles a chat template in Jinja's immutable sandbox, whose attribute lookup (``message.role``)
first asks the dict for an attribute, fails with an AttributeError, then looks the key up. That failure costs two
thirds of a template's time per message (Qwen2.5's: 3 us of every message's 4.5 us, the renderings of a 40-turn
conversation's windows included). ``fast_template`` compiles the same source in an overlay of transformers'
environment (its filters, globals and extensions, jinja's own way to derive one) whose lookup answers a plain
dict's keys directly, and defers everything else to the sandbox: the same value or the same undefined for every
name a dict has no attribute of, so the same text.
"""

from __future__ import annotations

import functools

from jinja2 import Template
from jinja2.sandbox import ImmutableSandboxedEnvironment

_DICT_ATTRIBUTES = frozenset(dir(dict))  # the only names getattr finds on a dict (it has no instance __dict__)


class _DictKeysFirst(ImmutableSandboxedEnvironment):
    """The immutable sandbox, with a lookup that answers a plain dict's keys without raising first."""

    def getattr(self, obj, attribute: str):
        if type(obj) is dict and type(attribute) is str and attribute not in _DICT_ATTRIBUTES:
            return obj[attribute] if attribute in obj else self.undefined(obj=obj, name=attribute)
        return super().getattr(obj, attribute)


@functools.lru_cache(maxsize=32)
def fast_template(compiled: Template, source: str) -> Template:
    """``source`` compiled as ``compiled`` (transformers' ``_compile_jinja_template``) is, with dict lookups that
    raise nothing; ``compiled`` itself where its environment is not the immutable sandbox this derives from. Compiled
    once per template (as transformers caches its own): a template renders without changing itself, so every
    encoder of the same template shares it (compiling one is 10-20 ms, and a run or a test makes many encoders)."""
    if type(compiled.environment) is not ImmutableSandboxedEnvironment:
        return compiled
    env = compiled.environment.overlay()
    env.__class__ = _DictKeysFirst  # the overlay is this module's own object: transformers' stays as it was
    template = env.from_string(source)
    # its globals as a plain dict, not a ChainMap over the environment's: every render makes a set of them
    # (a ChainMap iterates in Python, 1 us a render); transformers never changes them after compiling
    template.globals = dict(template.globals)
    return template
