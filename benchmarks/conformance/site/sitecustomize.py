"""Put on PYTHONPATH by the conformance runner only (for the peer's run and for shardwise's): fixes the peers' test
harnesses (`harness.py`) and swaps the peers named in SHARDWISE_CONFORMANCE_SWAP for shardwise, in this process and
in every process it spawns (they inherit the environment)."""

from benchmarks.conformance.harness import install
from benchmarks.conformance.swap import install_from_env

install()
install_from_env()
