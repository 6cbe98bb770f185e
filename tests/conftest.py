"""Test configuration: eight virtual CPU devices for the multi-device tests.

XLA reads the flag when the backend starts, so it is set before any test
module imports jax.
"""

import atexit
import os
import shutil
import sys
import tempfile

_FLAG = '--xla_force_host_platform_device_count=8'
if _FLAG not in os.environ.get('XLA_FLAGS', ''):
  os.environ['XLA_FLAGS'] = (os.environ.get('XLA_FLAGS', '') + ' ' + _FLAG).strip()

# `experiments` and `configs` are top-level folders of the repository, not
# part of the installed package.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Optimized strategies are cached on disk; keep the tests' entries out of the
# user's cache.
os.environ['DPSCO_JAX_CACHE'] = tempfile.mkdtemp(prefix='dpsco_jax_cache_')
atexit.register(shutil.rmtree, os.environ['DPSCO_JAX_CACHE'],
                ignore_errors=True)
