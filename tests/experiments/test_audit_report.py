"""The audit report's families: calibrated claims and a small audit."""

import pytest

from experiments import audit_report


def test_every_family_claims_the_target_and_audits_below_it():
  families = audit_report.families(epsilon=0.5, delta=1e-5)
  assert len(families) == 7
  for family in families:
    assert family.claimed == pytest.approx(0.5, rel=1e-3), family.name
  report = audit_report.audit_family(families[0], num_runs=200, delta=1e-5,
                                     seed=0)
  assert report.epsilon_lower_bound < report.claimed_epsilon
  assert report.name.startswith('DP-SGD')
