#!/usr/bin/env bash
# Start tandem on the head node of a `ray up` cluster, once Ray runs there: deploy/aws.yaml,
# gcp.yaml and onprem.yaml run it as their last head start command,
#
#     bash ~/tandem/deploy/scripts/start-head.sh tandem serve --config FILE --ray-address auto ...
#
#   1. A Redis for the global prefix index where prefill workers on other nodes reach it: bound
#      to this node's Ray address, port $TANDEM_REDIS_PORT (6380), a random password kept in a
#      0600 file (never on a command line), no persistence; restarted on every `ray up`.
#      Skipped when ~/tandem-secrets/redis-url (first line) names another Redis, a managed one
#      say (redis:// or rediss://).
#   2. The command given (`tandem serve ... --detach`), in the background with TANDEM_REDIS_URL
#      in its environment: it waits while the autoscaler brings up the workers' nodes (minutes),
#      then serves; this script returns at once. Its output: ~/.tandem-deploy/serve-start.log,
#      then the server's log ~/.cache/tandem/run/serve-PORT.log.
set -euo pipefail
if [ "$#" -eq 0 ]; then
    echo "usage: start-head.sh COMMAND [ARG...]   (tandem serve --config FILE --ray-address auto ...)" >&2
    exit 2
fi

state=$HOME/.tandem-deploy
secrets=$HOME/tandem-secrets
mkdir -p "$state" && chmod 700 "$state"
if [ -d "$secrets" ]; then # file mounts keep the local modes: make sure no one else reads them
    chmod 700 "$secrets"
    find "$secrets" -type f -exec chmod 600 {} +
fi
export RAY_AUTH_MODE=token

if [ -s "$secrets/redis-url" ]; then
    redis_url=$(head -n 1 "$secrets/redis-url")
else
    ip=$(python -c 'import ray.util; print(ray.util.get_node_ip_address())')
    port=${TANDEM_REDIS_PORT:-6380}
    if [ ! -s "$state/redis-password" ]; then
        (umask 077 && python -c 'import secrets; print(secrets.token_hex(24))' >"$state/redis-password")
    fi
    password=$(cat "$state/redis-password")
    if [ -s "$state/redis.pid" ] && kill -0 "$(cat "$state/redis.pid")" 2>/dev/null; then
        kill "$(cat "$state/redis.pid")"
        for _ in $(seq 50); do
            kill -0 "$(cat "$state/redis.pid")" 2>/dev/null || break
            sleep 0.1
        done
    fi
    (
        umask 077
        cat >"$state/redis.conf" <<CONF
bind $ip
port $port
requirepass $password
protected-mode yes
save ""
appendonly no
daemonize yes
pidfile $state/redis.pid
logfile $state/redis.log
dir $state
CONF
    )
    "$(python -c 'from router.redis_server import find_redis_server; print(find_redis_server())')" \
        "$state/redis.conf"
    redis_url="redis://:$password@$ip:$port/0"
    echo "prefix-index Redis on $ip:$port (password in $state/redis-password)"
fi

TANDEM_REDIS_URL=$redis_url nohup "$@" >"$state/serve-start.log" 2>&1 </dev/null &
echo "started in the background: $*"
echo "follow it with: tail -f $state/serve-start.log"
