#!/bin/sh
# node-health job pre-flight: asks the node-health agent on this pod's node whether the node is ready for this
# job, and prints the agent's reasons with their fixes when it is not. It never hangs: when no agent answers it
# gives up after about 10 s. Needs only a POSIX sh and curl (the curlimages/curl image has both).
# How to use it: docs/preflight.md.
#
# Exit status:
#   0  ready; or no agent answered and NODE_HEALTH_FAIL_OPEN=1 (a warning line says so)
#   1  not ready: the agent's answer (reasons, each with its fix) is printed
#   2  the agent refused the question (a bad NODE_HEALTH_* value: its answer names it), or curl is missing
#   3  no agent answered within about 10 s: every attempt is printed with why it failed
#
# Environment:
#   NODE_HEALTH_URL               the agent's base URL; default http://agent.node-health.svc:9100 (the Service
#                                 `agent`, internalTrafficPolicy Local: only the agent on this node answers)
#   HOST_IP, NODE_HEALTH_HOST_PORT
#                                 when both are set, http://$HOST_IP:$NODE_HEALTH_HOST_PORT (the agent's host
#                                 port, deploy/components/host-port) is asked first, NODE_HEALTH_URL second
#   NODE_HEALTH_DEVICES           the devices this job uses: indices (0,1 or 0-3) or GPU UUIDs / MIG ids;
#                                 default ASCEND_VISIBLE_DEVICES, else NVIDIA_VISIBLE_DEVICES; empty, "all",
#                                 "none" or "void": every device of the node counts
#   NODE_HEALTH_MIN_HBM_FREE_MIB  free device memory each of those devices must have (MiB)
#   NODE_HEALTH_MIN_HOST_MEM_MIB  available host memory the node must have (MiB)
#   NODE_HEALTH_CHECKS            only these categories or checks count (e.g. npu,storage); default all
#   NODE_HEALTH_FAIL_OPEN         1: when no agent answers, warn and exit 0 instead of 3
set -u
set -f # no pathname expansion: URLs and device lists are split on purpose, never globbed

CONNECT_SECONDS=2 # per attempt, name resolution included
ANSWER_SECONDS=3  # per attempt: the agent answers from its cache in milliseconds
BUDGET_SECONDS=10 # all attempts together
ROUNDS=3          # each round asks every address once
SERVICE_URL=http://agent.node-health.svc:9100
NL='
'

say() { printf 'node-health pre-flight: %s\n' "$*"; }
warn() { printf 'node-health pre-flight: %s\n' "$*" >&2; }

trim() { # trim TEXT: without leading and trailing blanks
    _t=$1
    while :; do
        case $_t in
            [[:space:]]*) _t=${_t#?} ;;
            *[[:space:]]) _t=${_t%?} ;;
            *) break ;;
        esac
    done
    printf '%s' "$_t"
}

expand_devices() { # expand_devices LIST: "0-3, 5" -> "0,1,2,3,5" (the Ascend runtime takes ranges; the agent a list)
    _out=
    _saved_ifs=$IFS
    IFS=,
    for _item in $1; do
        _item=$(trim "$_item")
        case $_item in
            [0-9]*-[0-9]*)
                _low=${_item%%-*}
                _high=${_item#*-}
                case $_low$_high in
                    *[!0-9]*) ;; # not a range of two numbers: the agent will say what is wrong with it
                    *)
                        # Short numbers only: a huge one would overflow the shell's arithmetic.
                        if [ ${#_low} -le 4 ] && [ ${#_high} -le 4 ] && [ "$_low" -le "$_high" ]; then
                            _item=$_low
                            _n=$((_low + 1))
                            while [ "$_n" -le "$_high" ]; do
                                _item=$_item,$_n
                                _n=$((_n + 1))
                            done
                        fi
                        ;;
                esac
                ;;
        esac
        [ -n "$_item" ] && _out=${_out:+$_out,}$_item
    done
    IFS=$_saved_ifs
    printf '%s' "$_out"
}

visible_devices() {
    if [ -n "${NODE_HEALTH_DEVICES+set}" ]; then
        _devices=$NODE_HEALTH_DEVICES
    elif [ -n "${ASCEND_VISIBLE_DEVICES:-}" ]; then
        _devices=$ASCEND_VISIBLE_DEVICES
    else
        _devices=${NVIDIA_VISIBLE_DEVICES:-}
    fi
    _devices=$(trim "$_devices")
    case $_devices in
        all | none | void | '') ;; # the NVIDIA runtime's words for every device / no device: all of them count
        *) expand_devices "$_devices" ;;
    esac
}

describe_failure() { # describe_failure CURL_EXIT: why the attempt failed, for the job log
    case $1 in
        6) echo "could not resolve the host name (a hostNetwork pod needs dnsPolicy: ClusterFirstWithHostNet)" ;;
        7) echo "connection refused or address unreachable (no agent listening there)" ;;
        28) echo "no answer within the timeout (dropped: no ready agent behind the Service on this node?)" ;;
        52) echo "the server closed the connection without answering" ;;
        56) echo "the connection was reset" ;;
        *) echo "curl failed with exit status $1" ;;
    esac
}

# ask BASE_URL CONNECT_SECONDS MAX_SECONDS: one GET of /ready. Sets ANSWER_CODE (000 when nothing answered),
# ANSWER_BODY, ANSWER_URL and CURL_EXIT.
ask() {
    _base=${1%/}
    set -- --silent --noproxy '*' --proto '=http,https' --max-filesize 1048576 \
        --connect-timeout "$2" --max-time "$3" --header 'Accept: text/plain' --get
    # curl encodes each value: a device list, a UUID or anything else reaches the agent as one parameter.
    [ -n "$QUERY_DEVICES" ] && set -- "$@" --data-urlencode "devices=$QUERY_DEVICES"
    _hbm=${NODE_HEALTH_MIN_HBM_FREE_MIB:-}
    _host_mem=${NODE_HEALTH_MIN_HOST_MEM_MIB:-}
    _checks=${NODE_HEALTH_CHECKS:-}
    [ -n "$_hbm" ] && set -- "$@" --data-urlencode "min_hbm_free_mib=$_hbm"
    [ -n "$_host_mem" ] && set -- "$@" --data-urlencode "min_host_mem_mib=$_host_mem"
    [ -n "$_checks" ] && set -- "$@" --data-urlencode "checks=$_checks"
    _response=$(curl "$@" --write-out "$NL%{http_code} %{url_effective}" "$_base/ready")
    CURL_EXIT=$?
    _status_line=${_response##*"$NL"}
    ANSWER_BODY=${_response%"$NL"*}
    [ "$ANSWER_BODY" = "$_response" ] && ANSWER_BODY=
    while :; do # the body's own final newline; printing it adds one
        case $ANSWER_BODY in
            *"$NL") ANSWER_BODY=${ANSWER_BODY%"$NL"} ;;
            *) break ;;
        esac
    done
    ANSWER_CODE=${_status_line%% *}
    ANSWER_URL=${_status_line#* }
    [ "$CURL_EXIT" -eq 0 ] || ANSWER_CODE=000
}

says_ready() { # the body of a 200 is node-health's "ready" (text, or JSON from an agent that predates text)
    _first=${ANSWER_BODY%%"$NL"*}
    case $_first in
        ready | ready[[:space:]:]*) return 0 ;;
    esac
    case $ANSWER_BODY in
        '{'*'"ready": true'* | '{'*'"ready":true'*) return 0 ;;
    esac
    return 1
}

if ! command -v curl >/dev/null 2>&1; then
    warn "curl is not installed in this container: use an image that has it (e.g. curlimages/curl)"
    exit 2
fi

QUERY_DEVICES=$(visible_devices)
CANDIDATES=
if [ -n "${HOST_IP:-}" ] && [ -n "${NODE_HEALTH_HOST_PORT:-}" ]; then
    case $HOST_IP in
        *:*) CANDIDATES="http://[$HOST_IP]:$NODE_HEALTH_HOST_PORT" ;; # IPv6
        *) CANDIDATES="http://$HOST_IP:$NODE_HEALTH_HOST_PORT" ;;
    esac
fi
CANDIDATES="$CANDIDATES ${NODE_HEALTH_URL:-$SERVICE_URL}"

started=$(date +%s)
tried=
round=1
while [ "$round" -le "$ROUNDS" ]; do
    for base in $CANDIDATES; do
        left=$((started + BUDGET_SECONDS - $(date +%s)))
        [ "$left" -ge 1 ] || break 2
        max=$ANSWER_SECONDS
        [ "$left" -lt "$max" ] && max=$left
        connect=$CONNECT_SECONDS
        [ "$max" -lt "$connect" ] && connect=$max
        ask "$base" "$connect" "$max"
        case $ANSWER_CODE in
            200)
                if says_ready; then
                    say "$ANSWER_URL answered 200"
                    printf '%s\n' "$ANSWER_BODY"
                    exit 0
                fi
                why="answered 200, but not as node-health does: ${ANSWER_BODY%%"$NL"*}"
                ;;
            503)
                say "$ANSWER_URL answered 503: this node is not ready for the job"
                printf '%s\n' "$ANSWER_BODY"
                exit 1
                ;;
            400)
                say "$ANSWER_URL answered 400: the agent refused the question (check the NODE_HEALTH_* values)"
                printf '%s\n' "$ANSWER_BODY"
                exit 2
                ;;
            000) why=$(describe_failure "$CURL_EXIT") ;;
            *) why="answered HTTP $ANSWER_CODE: ${ANSWER_BODY%%"$NL"*}" ;;
        esac
        tried="$tried$NL  round $round: ${ANSWER_URL:-$base/ready}: $why"
    done
    round=$((round + 1))
    left=$((started + BUDGET_SECONDS - $(date +%s)))
    [ "$round" -le "$ROUNDS" ] && [ "$left" -gt 1 ] && sleep 1
done

elapsed=$(($(date +%s) - started))
case ${NODE_HEALTH_FAIL_OPEN:-0} in
    1 | true | yes)
        warn "WARNING: no node-health agent answered within ${elapsed} s; the job starts unchecked" \
            "(NODE_HEALTH_FAIL_OPEN=1). Tried:$tried"
        exit 0
        ;;
esac
warn "no node-health agent answered within ${elapsed} s, so this node's health is unknown. Tried:$tried"
warn "is the node-health agent running and ready on this node? (kubectl -n node-health get pods -o wide)"
exit 3
