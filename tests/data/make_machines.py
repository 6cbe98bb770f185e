"""Writes machines.csv: a small synthetic predictive-maintenance table.

300 machines; the target `failure` ('yes'/'no') depends on torque, tool
wear and the temperature difference. `udi` is a row identifier and
`failure_code` is derived from the label (0 without a failure, the failure
type otherwise): both must stay out of the features. `torque_nm` also
serves as a regression target. Run `python tests/data/make_machines.py`
to rebuild the file (seeded: the same file every time).
"""

import os

import numpy as np


def main():
  rng = np.random.default_rng(27)
  n = 300
  air = rng.normal(300.0, 2.0, n)
  process = air + 10.0 + rng.normal(0.0, 1.0, n)
  rpm = rng.normal(1500.0, 150.0, n)
  torque = np.clip(70.0 - 0.02 * rpm + rng.normal(0.0, 6.0, n), 3.0, 77.0)
  wear = rng.uniform(0.0, 250.0, n)
  logit = (-1.2 + 0.12 * (torque - 40.0) + 0.015 * (wear - 125.0)
           - 0.4 * (process - air - 10.0))
  failed = rng.random(n) < 1.0 / (1.0 + np.exp(-logit))
  code = np.where(failed, 1 + (torque > 45) + (wear > 180), 0)
  path = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                      'machines.csv')
  with open(path, 'w') as f:
    f.write('udi,air_temp_k,process_temp_k,rotation_rpm,torque_nm,'
            'tool_wear_min,failure_code,failure\n')
    for i in range(n):
      f.write(f'{10001 + i},{air[i]:.1f},{process[i]:.1f},{rpm[i]:.0f},'
              f'{torque[i]:.1f},{wear[i]:.0f},{code[i]},'
              f'{"yes" if failed[i] else "no"}\n')


if __name__ == '__main__':
  main()
