#!/usr/bin/env bash
# Install the peer routers, each into its own venv, never into kvgate's environment.
#   loadtest/peers/install.sh [sglang-router] [vllm-router] [litellm] [smg]   (default: all four)
# Venvs go under ${KVGATE_PEERS_DIR:-$HOME/.cache/kvgate/peers}/<name>. Versions are the ones the
# benchmarks were run with; override with SGLANG_ROUTER_SPEC, VLLM_ROUTER_SPEC, LITELLM_SPEC, SMG_SPEC.
# smg (Shepherd Model Gateway) is the successor of sglang-router; both ship a console script named
# `smg`, which is why each lives in a venv of its own.
set -euo pipefail

PEERS_DIR="${KVGATE_PEERS_DIR:-$HOME/.cache/kvgate/peers}"
PYTHON="${PYTHON:-python3}"
declare -A SPEC=(
  [sglang-router]="${SGLANG_ROUTER_SPEC:-sglang-router==0.3.2}"
  [vllm-router]="${VLLM_ROUTER_SPEC:-vllm-router==0.1.17}"
  [litellm]="${LITELLM_SPEC:-litellm[proxy]==1.108.7}"
  [smg]="${SMG_SPEC:-smg==1.13.0}"
)

if [ "$#" -eq 0 ]; then
  set -- sglang-router vllm-router litellm smg
fi

mkdir -p "$PEERS_DIR"
status=0
for name in "$@"; do
  spec="${SPEC[$name]:-}"
  if [ -z "$spec" ]; then
    echo "unknown peer '$name' (known: ${!SPEC[*]})" >&2
    status=2
    continue
  fi
  venv="$PEERS_DIR/$name"
  echo "installing $spec into $venv"
  if [ ! -x "$venv/bin/python" ]; then
    "$PYTHON" -m venv "$venv"
    "$venv/bin/pip" install -q -U pip
  fi
  # LiteLLM fetches its model cost map from the network on import unless told not to.
  if LITELLM_LOCAL_MODEL_COST_MAP=True "$venv/bin/pip" install -q "$spec"; then
    echo "$spec" > "$venv/.kvgate-peer"
    echo "ok: $name"
  else
    echo "failed: $name" >&2
    status=1
  fi
done
exit "$status"
