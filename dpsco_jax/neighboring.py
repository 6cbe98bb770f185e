"""Neighbouring relations: what "changing one example (or user)" means.

The relation fixes two things that must agree: the l2 sensitivity that a
clipped statistic guarantees (see `dpsco_jax.clipping`) and the relation the
accountant assumes (see `dpsco_jax.accounting`). Keeping it in one enum, shared
by both, is what stops the two from drifting apart.
"""

import enum

import dp_accounting


class NeighboringRelation(enum.Enum):
  """Which pairs of data sets count as neighbours.

  Attributes:
    ADD_OR_REMOVE: one data set has one extra example (or user). A clipped sum
      moves by at most the clip norm.
    REPLACE_ONE: one example is replaced by an arbitrary other example. A
      clipped sum moves by at most twice the clip norm.
    ZERO_OUT: one example is replaced by a "zero" example whose gradient is 0
      everywhere (the relation of papers 000/001). A clipped sum moves by at
      most the clip norm.
  """

  ADD_OR_REMOVE = 'add_or_remove'
  REPLACE_ONE = 'replace_one'
  ZERO_OUT = 'zero_out'


def sensitivity_factor(relation: NeighboringRelation) -> float:
  """Sensitivity of a sum of contributions of norm <= 1 under `relation`.

  Args:
    relation: the neighbouring relation.

  Returns:
    1.0 for add/remove and zero-out, 2.0 for replace-one.
  """
  relation = NeighboringRelation(relation)
  return 2.0 if relation is NeighboringRelation.REPLACE_ONE else 1.0


def to_dp_accounting(
    relation: NeighboringRelation,
) -> dp_accounting.NeighboringRelation:
  """The `dp_accounting` relation that models `relation`.

  Args:
    relation: the neighbouring relation.

  Returns:
    The matching `dp_accounting.NeighboringRelation` (zero-out is the
    library's REPLACE_SPECIAL).
  """
  relation = NeighboringRelation(relation)
  return {
      NeighboringRelation.ADD_OR_REMOVE:
          dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE,
      NeighboringRelation.REPLACE_ONE:
          dp_accounting.NeighboringRelation.REPLACE_ONE,
      NeighboringRelation.ZERO_OUT:
          dp_accounting.NeighboringRelation.REPLACE_SPECIAL,
  }[relation]
