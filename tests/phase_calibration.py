"""One phase's outlier-removal calibration, written out for the tests.

`outlier_removal.calibrate(512, 0.5, 8.0, 1e-5, num_steps=3,
population=2048, score_radius=1.0)` (Algorithm 2: AboveThreshold over 3
steps on 512 of 2048 users) takes a PLD search of seconds. Tests that use
its noise levels, not its search, share this record of what it returns;
tests/algorithms/test_accelerated_phased_erm.py checks that `calibrate`
still returns exactly this, so the record cannot drift from the library.
"""

from dpsco_jax import outlier_removal

ARGUMENTS = dict(num_points=512, tau=0.5, epsilon=8.0, delta=1e-5,
                 num_steps=3, population=2048, score_radius=1.0)

PHASE = outlier_removal.OutlierRemovalCalibration(
    num_points=512, tau=0.5, score_radius=1.0, threshold=409.6,
    cutoff=341.3333333333333, laplace_scale=2.0476036242635716,
    threshold_scale=1.0238018121317858, inclusion='weighted',
    sensitivity=0.1755185232006802, noise_std=0.21060294479993727,
    num_steps=3, population=2048, epsilon=8.0, delta=1e-05,
    score_epsilon=3.9070061730708403, tail_delta=2.5e-06, coupling_delta=0.0,
    gaussian_delta=7.500000000000001e-06)
