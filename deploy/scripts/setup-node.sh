#!/usr/bin/env bash
# Set up one node of a `ray up` cluster for tandem: deploy/aws.yaml, gcp.yaml and onprem.yaml run
# it as their first setup command, on the head and on every worker node. Idempotent: `ray up`
# runs it again on every update.
#
#   TANDEM_PACKAGE  what pip installs as tandem (default: ~/tandem, the checkout `ray up` synced
#                   there from the machine it ran on); or a wheel path, or a git URL such as
#                   "tandem @ git+https://github.com/ORG/tandem.git@TAG"
#   RAY_VERSION     Ray on the cluster (default 2.60.0); must be the version that runs `ray up`
#   TANDEM_VENV     the virtualenv everything goes into (default ~/tandem-venv); the login shells
#                   `ray up` uses activate it through ~/.bashrc
#
# On a node with an NVIDIA GPU it also installs cupy for the CUDA major version torch was built
# with (the NCCL KV transport uses cupy's NCCL bindings).
set -euo pipefail

pkg=${TANDEM_PACKAGE:-$HOME/tandem}
ray_version=${RAY_VERSION:-2.60.0}
venv=${TANDEM_VENV:-$HOME/tandem-venv}

apt_install() {
    sudo apt-get -o DPkg::Lock::Timeout=600 update -qq
    sudo DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 install -y -qq "$@"
}

if [ ! -x "$venv/bin/pip" ]; then
    rm -rf "$venv"
    if ! python3 -m venv "$venv" >/dev/null 2>&1; then
        rm -rf "$venv"
        apt_install python3-venv
        python3 -m venv "$venv"
    fi
fi
# Login shells (every command `ray up` runs) use the venv and Ray's token auth.
for line in "source $venv/bin/activate" "export RAY_AUTH_MODE=token"; do
    grep -qxF "$line" ~/.bashrc 2>/dev/null || echo "$line" >>~/.bashrc
done
# shellcheck disable=SC1091
source "$venv/bin/activate"

python -m pip install -q --upgrade pip
python -m pip install -q "ray[default]==$ray_version"
python -m pip install -q "$pkg"
if nvidia-smi -L >/dev/null 2>&1; then
    cuda_major=$(python -c 'import torch; print((torch.version.cuda or "").split(".")[0])')
    if [ -z "$cuda_major" ]; then
        echo "setup-node.sh: this node has a GPU but torch is a CPU build" >&2
        exit 1
    fi
    python -m pip install -q "cupy-cuda${cuda_major}x"
fi
echo "tandem $(python -c 'import importlib.metadata as m; print(m.version("tandem"))'), ray $ray_version in $venv"
