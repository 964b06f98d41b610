"""What every feature record shares: how a field declares itself, and how records read Megatron-LM ``args``.

A feature record is a frozen, keyword-only dataclass of one megatron-core capability (positional encoding,
attention, norms, the MLP, Mixture of Experts, multi-latent attention, ...). Each of its fields declares, in its
``metadata`` (made by :func:`setting`):

- ``kind``: ``SETTING`` (changes the forward pass: every Hugging Face family must say whether it expresses the
  value, ``models.base.Family.expresses``), ``SIZE`` (a size every family that has the feature writes: the name
  tables and config writers carry it), ``LAYOUT`` (how the tensors are stored, never the math) or ``NUMERICS``
  (the precision a computation runs in: carried between Megatron formats, not a different function);
- ``arg``: the Megatron-LM ``args`` names it is read from (the first is written; megatron-core's
  ``TransformerConfig`` field of the same name unless ``config`` says otherwise);
- ``what``: a few words for refusals and ``inspect``;
- ``mlm``: how Megatron-LM knows its ``arg`` names (:class:`MegatronArg`, one per name): the rows of
  ``mlm_args.ARGS`` that are a setting's.

A record checks its own limits on a parallel layout (``check_layout``: heads it splits by, stages it needs).

The record reads and writes its own ``args`` (``from_args`` / ``to_args``: by default each field under its ``arg``
names, a record adding only what its names need more); nothing else in dist_convert interprets those fields.
"""
from __future__ import annotations

import argparse
import dataclasses
from abc import ABC
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, ClassVar, NamedTuple

if TYPE_CHECKING:  # a record reads the model's and the layout's attributes; it imports neither module
    from ..config import ModelConfig
    from ..layout.topology import Layout

SETTING, SIZE, LAYOUT, NUMERICS = "setting", "size", "layout", "numerics"
MODEL, DERIVED = "cfg", "derived"  # where mlm_args.complete_args takes an args value from (mlm_args.CFG / DERIVED)


class _FieldDefault:
    def __repr__(self) -> str:
        return "FIELD_DEFAULT"


FIELD_DEFAULT: Any = _FieldDefault()  # a MegatronArg default: the field's own


class MegatronArg(NamedTuple):
    """One of a setting's args names as Megatron-LM 0.19 knows it (its row of ``mlm_args.ARGS``): the loaders that
    read it (``mlm_args``' letters), where ``complete_args`` takes its value from (``MODEL``: the model config, and
    Megatron-LM's default where the feature is absent; ``DERIVED``: always written; "": the source's, else the
    default) and Megatron-LM's argparse default (``FIELD_DEFAULT``: the field's own)."""

    readers: str
    source: str = ""
    default: Any = FIELD_DEFAULT


class Setting(NamedTuple):
    """One setting of a model as it is compared with what a target can write: its key (``record.field``, or a core
    field; an optional record's name alone says whether the model has it), value, the value a target that does not
    mention it must see (the field's default), the Megatron-LM name and what it is."""

    key: str
    value: Any
    plain: Any
    arg: str
    what: str


def setting(default: Any, *, arg: str | tuple[str, ...] = (), what: str = "", kind: str = SETTING,
            config: str | tuple[str, ...] | None = None, low: int | None = None, above: float | None = None,
            high: str | None = None, mlm: MegatronArg | tuple[MegatronArg | None, ...] | None = None,
            record: type[Feature] | None = None) -> Any:
    """A feature record's field: its default and what it is (module docstring). ``config``: the megatron-core
    ``TransformerConfig`` / ``GPTModel`` names it stands for, when they are not ``arg``'s. The values that mean
    something, where not all do (a record holding another is refused as it is made, i.e. where the setting is read):
    ``low``, the least; ``above``, a bound they exceed; ``high``, the record's field they do not exceed. ``mlm``: how
    Megatron-LM knows ``arg``'s names, one per name (None: not a row of ``mlm_args.ARGS``), or the first name's.
    ``record``: the field holds a record of that type (one of its ``variants``), whose fields are settings in their own
    right (``record.field.subfield``)."""
    args = (arg,) if isinstance(arg, str) else tuple(arg)
    configs = args if config is None else (config,) if isinstance(config, str) else tuple(config)
    known = (mlm,) if isinstance(mlm, MegatronArg) else tuple(mlm or ())
    known = tuple(None if k is None else k._replace(default=default) if k.default is FIELD_DEFAULT else k
                  for k in known) + (None,) * (len(args) - len(known))
    return dataclasses.field(default=default, metadata={"kind": kind, "arg": args, "what": what, "config": configs,
                                                        "low": low, "above": above, "high": high, "mlm": known,
                                                        "record": record})


def get(args: argparse.Namespace | dict[str, Any], *names: str, default: Any = None) -> Any:
    """The first of ``names`` the args hold with a value (not None), else ``default``."""
    d = args if isinstance(args, dict) else vars(args)
    for name in names:
        if d.get(name) is not None:
            return d[name]
    return default


def as_tuple(value: Any) -> Any:
    """Lists (as pickled args or JSON hold them) as tuples, nested, so records stay hashable."""
    if isinstance(value, (list, tuple)):
        return tuple(as_tuple(v) for v in value)
    return value


class Feature(ABC):
    """The base of the feature records (frozen, keyword-only dataclasses). ``attr``: the ``ModelConfig`` attribute
    holding it (its ``inspect`` group)."""

    attr: ClassVar[str]
    presence: ClassVar[tuple[str, ...]] = ()  # megatron-core names that say an optional feature is there
    what: ClassVar[str] = ""  # an optional feature, in a refusal's words
    essential: ClassVar[tuple[str, ...] | None] = None  # what inspect always shows (None: every field)
    # megatron-core (Megatron-Bridge's spec for it) builds a model with this feature from Transformer Engine 2's
    # modules, whose final norm saves an ``_extra_state`` in torch_dist
    te2_spec: ClassVar[bool] = False

    @property
    def uses_te2_spec(self) -> bool:
        """Whether this record makes the model one built from Transformer Engine 2's modules (``te2_spec``)."""
        return self.te2_spec

    def __post_init__(self) -> None:
        """Every setting within its declared range (``setting(low=..., above=..., high=...)``), else one line
        naming it."""
        from ..errors import ConvertError

        for name, value, f in self.fields():
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            low, above, high = (f.metadata.get(k) for k in ("low", "above", "high"))
            bound = getattr(self, high) if high is not None else None
            rule = f"at least {low}" if low is not None and value < low else \
                f"above {above}" if above is not None and not value > above else \
                f"at most {_arg_of(self, high)} ({bound})" if bound is not None and value > bound else None
            if rule is not None:
                names = " / ".join(f.metadata.get("arg") or (name,))
                raise ConvertError(f"{type(self).__name__} setting {names} = {value} has no meaning: "
                                   f"{f.metadata.get('what') or name} must be {rule}",
                                   "correct it in the source's config (config.json, or the checkpoint's args)")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> Any:
        """The record the Megatron-LM ``args`` describe (None for an optional feature the model lacks): by default
        each field as :meth:`args_values` reads it; a record overrides this where its names need more."""
        return cls(**cls.args_values(args))

    @classmethod
    def args_values(cls, args: argparse.Namespace) -> dict[str, Any]:
        """Each field with ``arg`` names, from the first of them the args hold (not None), else what an absent name
        means (Megatron-LM's default, ``setting(mlm=...)``, else the field's), as the field's type."""
        a = vars(args)
        out: dict[str, Any] = {}
        for f in dataclasses.fields(cls):  # type: ignore[arg-type]
            if f.metadata.get("arg"):
                value = get(a, *f.metadata["arg"])
                known = f.metadata["mlm"][0]
                out[f.name] = _typed(f, value if value is not None else f.default if known is None else known.default)
        return out

    def to_args(self) -> dict[str, Any]:
        """The Megatron-LM ``args`` fields that say this record (``from_args`` reads them back): by default each field
        under each of its ``arg`` names, tuples as lists."""
        return {name: list(v) if isinstance(v, tuple) else v for _, v, f in self.fields() for name in f.metadata["arg"]}

    @classmethod
    def variants(cls) -> tuple[type[Feature], ...]:
        """The record types a model's record of this feature is one of: the record itself, unless the feature comes
        in kinds of their own (the vision towers)."""
        return (cls,)

    @classmethod
    def all_fields(cls) -> list[dataclasses.Field]:
        """Every field a record of this feature can have, once each, in order: each variant's."""
        out: dict[str, dataclasses.Field] = {}
        for kind in cls.variants():
            for f in dataclasses.fields(kind):  # type: ignore[arg-type]
                out.setdefault(f.name, f)
        return list(out.values())

    @classmethod
    def leaf_fields(cls) -> list[tuple[str, dataclasses.Field]]:
        """(path, field) of every field a record of this feature can hold (``all_fields``), a field holding a record
        (``setting(record=...)``) followed by each of that record's kinds' fields as ``field.subfield``: every
        declaration, since two kinds may say one field under other names (a path may come more than once)."""
        out: list[tuple[str, dataclasses.Field]] = []
        for f in cls.all_fields():
            out.append((f.name, f))
            if (sub := f.metadata.get("record")) is not None:
                out += [(f"{f.name}.{g.name}", g) for kind in sub.variants() for g in dataclasses.fields(kind)]
        return out

    def check_layout(self, cfg: ModelConfig, layout: Layout, what: str) -> None:
        """Refuse, in one line naming the setting and the flag, a ``what`` ("target" or "source") layout megatron-core
        does not build this feature in (``ModelConfig.check_layout`` asks each record; none unless a record says)."""
        return None

    def layout_args(self, cfg: ModelConfig, layout: Layout) -> dict[str, Any]:
        """The Megatron-LM ``args`` fields this record says differently at ``layout`` than the layout's own fields do
        (the layout's, after them; none unless a record says)."""
        return {}

    @staticmethod
    def absent_args() -> dict[str, Any]:
        """The Megatron-LM ``args`` fields that say an optional feature is absent (none unless a record says)."""
        return {}

    def fields(self) -> Iterator[tuple[str, Any, dataclasses.Field]]:
        """(name, value, field) of each field."""
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            yield f.name, getattr(self, f.name), f

    def settings(self, key: str, kinds: tuple[str, ...]) -> list[Setting]:
        """This record's fields of ``kinds`` as settings under ``key`` (``key.field``); a field holding a record says
        its kind (the record's ``name``, under its megatron-core name), then that record's own settings follow."""
        plain, out = type(self)(), []
        for name, value, f in self.fields():
            if f.metadata.get("kind") not in kinds:
                continue
            if f.metadata.get("record") is None:
                out.append(Setting(f"{key}.{name}", value, getattr(plain, name), arg_name(f), f.metadata["what"]))
                continue
            out.append(Setting(f"{key}.{name}", None if value is None else value.name, None, f.metadata["config"][0],
                               f.metadata["what"]))
            if value is not None:
                out += value.settings(f"{key}.{name}", kinds)
        return out

    def shown(self) -> list[str]:
        """The fields ``inspect`` shows (the record's group there): every field of an optional feature; of a record
        every model has, its ``essential`` fields and those that differ from the plain record's."""
        if self.essential is None:
            return [name for name, _, _ in self.fields()]
        plain = type(self)()
        return [name for name, value, _ in self.fields() if name in self.essential or value != getattr(plain, name)]


_TYPES = {"bool": bool, "int": int, "float": float, "str": str}


def _typed(f: dataclasses.Field, value: Any) -> Any:
    """``value`` as field ``f`` holds it: its declared bool, int, float or str (None stays), else lists as tuples."""
    kind = _TYPES.get(str(f.type).removesuffix(" | None"))
    return value if value is None else kind(value) if kind is not None else as_tuple(value)


def layout_flag(what: str, flag: str = "--target-tp") -> str:
    """What changes a ``what`` layout, for a refusal's fix: ``flag`` for the target, else the source's own layout."""
    return flag if what == "target" else "the source layout"


def _arg_of(record: Feature, name: str) -> str:
    return arg_name(next(f for f in dataclasses.fields(record) if f.name == name))  # type: ignore[arg-type]


def arg_name(f: dataclasses.Field) -> str:
    """The Megatron-LM name a field is known by (its first ``arg``), else its own name."""
    return f.metadata["arg"][0] if f.metadata.get("arg") else f.name
