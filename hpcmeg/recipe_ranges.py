"""Numeric ranges of recipe fields: ``ranged(default, ge=..., gt=..., le=..., lt=...)`` puts the range
next to the field in hpcmeg/recipe_schema.py; ``hpcmeg.recipe.validate`` checks every field that carries
one, and the messages say the range in words (`Range.describe`)."""

from __future__ import annotations

from dataclasses import Field, dataclass, field
from typing import Optional


@dataclass(frozen=True)
class Range:
    """The values a numeric field accepts (None = that side unbounded); `hpcmeg.recipe.validate`
    checks every field that carries one, so the range written next to a field is the only one."""

    ge: Optional[float] = None
    gt: Optional[float] = None
    le: Optional[float] = None
    lt: Optional[float] = None
    zero: Optional[str] = None
    """What 0 means for this field (shown in the message, e.g. 'no clipping')."""
    null: Optional[str] = None
    """What null means for an Optional field (shown in the message, e.g. 'keep all')."""

    def accepts(self, v: float) -> bool:
        return ((self.ge is None or v >= self.ge) and (self.gt is None or v > self.gt)
                and (self.le is None or v <= self.le) and (self.lt is None or v < self.lt))

    def describe(self) -> str:
        """'at least 1', 'greater than 0', 'in [0, 1)', plus what 0 / null mean."""
        lo = self.ge if self.ge is not None else self.gt
        hi = self.le if self.le is not None else self.lt
        if lo is not None and hi is not None:
            text = f"in {'[' if self.ge is not None else '('}{_num(lo)}, {_num(hi)}{']' if self.le is not None else ')'}"
        elif lo is not None:
            text = f"of at least {_num(lo)}" if self.ge is not None else f"greater than {_num(lo)}"
        else:
            text = f"of at most {_num(hi)}" if self.le is not None else f"below {_num(hi)}"
        if self.zero:
            text += f" (0 = {self.zero})"
        if self.null:
            text += f", or null ({self.null})"
        return text


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else repr(x)


def ranged(default, **limits) -> Field:
    """A field with a default and a `Range` (``ranged(10, ge=1)``: an integer count of at least 1)."""
    return field(default=default, metadata={"range": Range(**limits)})


def field_range(f: Field) -> Optional[Range]:
    return f.metadata.get("range")
