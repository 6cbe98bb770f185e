"""Neighbouring relations: sensitivity factors and the dp_accounting mapping."""

import dp_accounting
import pytest

from dpsco_jax.neighboring import NeighboringRelation
from dpsco_jax.neighboring import sensitivity_factor
from dpsco_jax.neighboring import to_dp_accounting


@pytest.mark.parametrize('relation,factor,theirs', [
    (NeighboringRelation.ADD_OR_REMOVE, 1.0,
     dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE),
    (NeighboringRelation.REPLACE_ONE, 2.0,
     dp_accounting.NeighboringRelation.REPLACE_ONE),
    (NeighboringRelation.ZERO_OUT, 1.0,
     dp_accounting.NeighboringRelation.REPLACE_SPECIAL),
])
def test_factor_and_mapping(relation, factor, theirs):
  assert sensitivity_factor(relation) == factor
  assert sensitivity_factor(relation.value) == factor
  assert to_dp_accounting(relation) is theirs


def test_unknown_relation():
  with pytest.raises(ValueError):
    sensitivity_factor('swap_two')
