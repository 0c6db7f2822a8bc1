#!/bin/sh
# node-health job pre-flight: asks the node-health agent on this pod's node whether the node is ready for this
# job, and prints the agent's reasons with their fixes when it is not. It never hangs: when no agent answers it
# gives up after about 10 s. Needs only a POSIX sh and curl (the curlimages/curl image has both); runs the same
# under sh, dash, busybox sh, bash and bash -e (how GitHub's runner runs a job hook). How to use it:
# docs/preflight.md.
#
# Exit status:
#   0  ready; or no agent answered and NODE_HEALTH_FAIL_OPEN=1 (a warning line says so)
#   1  not ready: the agent's answer (reasons, each with its fix) is printed
#   2  the agent refused the question (a bad NODE_HEALTH_* value: its answer names it), a bad
#      NODE_HEALTH_WAIT_SECONDS, or curl is missing
#   3  no agent answered within about 10 s: every attempt is printed with why it failed
#   4  the agent is overloaded: it refused the connection for load (503 "too many connections", 429, or a
#      reset) until NODE_HEALTH_WAIT_SECONDS ran out; never failed open
#
# Environment:
#   NODE_HEALTH_URL               the agent's base URL; default http://agent.node-health.svc:9100 (the Service
#                                 `agent`, internalTrafficPolicy Local: only the agent on this node answers)
#   HOST_IP, NODE_HEALTH_HOST_PORT
#                                 when both are set, http://$HOST_IP:$NODE_HEALTH_HOST_PORT (the agent's host
#                                 port, deploy/components/host-port) is asked first, NODE_HEALTH_URL second
#   POD_NAMESPACE, POD_NAME       this pod (downward API: metadata.namespace, metadata.name): when both are set
#                                 the agent judges exactly the devices the kubelet allocated to the pod (pod=),
#                                 and the devices below are only its fallback. An agent that cannot read the
#                                 kubelet's ledger is asked about the devices below instead, and one that predates
#                                 pod= (it answers 400) is asked without it
#   NODE_HEALTH_DEVICES           the devices this job uses: indices (0,1 or 0-3) or GPU UUIDs / MIG ids;
#                                 default ASCEND_VISIBLE_DEVICES, else NVIDIA_VISIBLE_DEVICES; empty, "all",
#                                 "none" or "void": every device of the node counts
#   NODE_HEALTH_MIN_HBM_FREE_MIB  free device memory each of those devices must have (MiB)
#   NODE_HEALTH_MIN_HOST_MEM_MIB  available host memory the node must have (MiB)
#   NODE_HEALTH_CHECKS            only these categories or checks count (e.g. npu,storage); default all
#   NODE_HEALTH_FAIL_OPEN         1: when no agent answers, warn and exit 0 instead of 3
#   NODE_HEALTH_WAIT_SECONDS      how long to keep asking while the agent answers but cannot vouch yet (every
#                                 reason WarmingUp: it has just started; or PodNotInLedger / PodDevicesUnknown: the
#                                 pod's devices are not known yet) or refuses for load; default 30, 0 not at all.
#                                 A real not-ready answer is never waited out, and no answer at all still gives up
#                                 after about 10 s
set -u
set -f # no pathname expansion: URLs and device lists are split on purpose, never globbed

CONNECT_SECONDS=2 # per attempt, name resolution included
ANSWER_SECONDS=3  # per attempt: the agent answers from its cache in milliseconds
BUDGET_SECONDS=10 # all attempts together while nothing answers
ROUNDS=3          # rounds without any answer; each round asks every address once
SERVICE_URL=http://agent.node-health.svc:9100
NL='
'

say() { printf 'node-health pre-flight: %s\n' "$*"; }
warn() { printf 'node-health pre-flight: %s\n' "$*" >&2; }

annotate() { # annotate error|warning TEXT: a GitHub Actions annotation on the run, when run by its runner
    if [ "${GITHUB_ACTIONS:-}" = true ]; then
        _in=$2
        _out=
        while :; do # workflow commands take % as an escape: %25
            case $_in in
                *%*)
                    _out=$_out${_in%%\%*}%25
                    _in=${_in#*\%}
                    ;;
                *) break ;;
            esac
        done
        printf '::%s title=node-health pre-flight::%s\n' "$1" "$_out$_in"
    fi
}

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
        if [ -n "$_item" ]; then
            _out=${_out:+$_out,}$_item
        fi
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
        *) echo "curl failed with exit status $1" ;;
    esac
}

# ask BASE_URL CONNECT_SECONDS MAX_SECONDS ACCEPT: one GET of /ready. Sets ANSWER_CODE (000 when nothing
# answered), ANSWER_BODY, ANSWER_URL and CURL_EXIT.
ask() {
    _base=${1%/}
    set -- --silent --noproxy '*' --proto '=http,https' --max-filesize 1048576 \
        --connect-timeout "$2" --max-time "$3" --header "Accept: $4" --get
    # curl encodes each value: a device list, a UUID or anything else reaches the agent as one parameter.
    if [ "$USE_POD" = 1 ]; then set -- "$@" --data-urlencode "pod=$QUERY_POD"; fi
    if [ -n "$QUERY_DEVICES" ]; then set -- "$@" --data-urlencode "devices=$QUERY_DEVICES"; fi
    _hbm=${NODE_HEALTH_MIN_HBM_FREE_MIB:-}
    _host_mem=${NODE_HEALTH_MIN_HOST_MEM_MIB:-}
    _checks=${NODE_HEALTH_CHECKS:-}
    if [ -n "$_hbm" ]; then set -- "$@" --data-urlencode "min_hbm_free_mib=$_hbm"; fi
    if [ -n "$_host_mem" ]; then set -- "$@" --data-urlencode "min_host_mem_mib=$_host_mem"; fi
    if [ -n "$_checks" ]; then set -- "$@" --data-urlencode "checks=$_checks"; fi
    # In an `if`: under `sh -e` / `bash -e` a failing command substitution would end the script here.
    if _response=$(curl "$@" --write-out "$NL%{http_code} %{url_effective}" "$_base/ready"); then
        CURL_EXIT=0
    else
        CURL_EXIT=$?
    fi
    _status_line=${_response##*"$NL"}
    ANSWER_BODY=${_response%"$NL"*}
    if [ "$ANSWER_BODY" = "$_response" ]; then ANSWER_BODY=; fi
    while :; do # the body's own final newline; printing it adds one
        case $ANSWER_BODY in
            *"$NL") ANSWER_BODY=${ANSWER_BODY%"$NL"} ;;
            *) break ;;
        esac
    done
    ANSWER_CODE=${_status_line%% *}
    ANSWER_URL=${_status_line#* }
    if [ "$CURL_EXIT" -ne 0 ]; then ANSWER_CODE=000; fi
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

says_not_ready() { # the body of a 503 is node-health's "not ready" (text, or JSON from an older agent)
    case $ANSWER_BODY in
        'not ready on '* | '{'*'"ready": false'* | '{'*'"ready":false'*) return 0 ;;
    esac
    return 1
}

says_overloaded() { # 429, or node-health's refusal of a connection for load: 503 {"error": "too many ..."}
    case $ANSWER_CODE:$ANSWER_BODY in
        429:* | 503:'{"error": "too many'*) return 0 ;;
    esac
    return 1
}

# waitable STATUS CHECK SUBJECT REASON: a reason the agent gives while it cannot vouch yet: WarmingUp (it has just
# started), or for pod= the pod's devices not known yet (the kubelet's ledger, the npu and gpu results catching up)
waitable() {
    case $1:$2:$3:$4 in
        unknown:*:-:WarmingUp:) return 0 ;;
        unknown:ready.pod:*:PodNotInLedger: | unknown:ready.pod:*:PodDevicesUnknown:) return 0 ;;
    esac
    return 1
}

fallback_scope() { # what is asked when pod= cannot be: the devices given, else the whole node
    if [ -n "$QUERY_DEVICES" ]; then printf 'devices %s' "$QUERY_DEVICES"; else printf 'every device of the node'; fi
}

ledger_unusable() { # a reason line says the agent cannot read the kubelet's ledger for pod=
    case $ANSWER_BODY in
        *"$NL"'unknown ready.pod '*' LedgerUnavailable: '* | *"$NL"'unknown ready.pod '*' LedgerStale: '*) return 0 ;;
    esac
    return 1
}

warming_up_only() { # every reason of the not-ready text answer is one to wait out (see waitable)
    _rest=${ANSWER_BODY#*"$NL"}
    if [ "$_rest" = "$ANSWER_BODY" ]; then return 1; fi
    _saved_ifs=$IFS
    IFS=$NL
    for _line in $_rest; do
        IFS=$_saved_ifs
        case $_line in
            '  '*) # a long reason's next line (the agent wraps its lines at 200 characters): its first line tells
                IFS=$NL
                continue
                ;;
            '... and '*) # more reasons than the text lists: ask for them all (JSON) and look at every one
                IFS=$_saved_ifs
                warming_up_in_json
                return
                ;;
        esac
        # shellcheck disable=SC2086 # split on purpose: status, check, subject, reason
        set -- $_line
        if ! waitable "${1:-}" "${2:-}" "${3:-}" "${4:-}"; then
            IFS=$_saved_ifs
            return 1
        fi
        IFS=$NL
    done
    IFS=$_saved_ifs
    return 0
}

pod_not_known() { # the answer waited out is about this pod's devices, not the agent's warm-up
    case $ANSWER_BODY in
        *' PodNotInLedger: '* | *' PodDevicesUnknown: '*) return 0 ;;
    esac
    return 1
}

waiting_for() {
    if pod_not_known; then
        echo "this pod's devices are not known yet (the kubelet's ledger or the agent's results are catching up)"
    else
        echo "the agent is warming up (no result yet for some checks)"
    fi
}

still_waiting() {
    if pod_not_known; then echo "this pod's devices still not known"; else echo "still warming up"; fi
}

warming_up_in_json() { # the same question as JSON: is every "reason" one to wait out?
    _text_body=$ANSWER_BODY
    _text_url=$ANSWER_URL
    ask "$WARM_BASE" "$CONNECT_SECONDS" "$ANSWER_SECONDS" application/json
    _json=$ANSWER_BODY
    ANSWER_BODY=$_text_body
    ANSWER_URL=$_text_url
    _seen=0
    while :; do
        case $_json in
            *'"reason": "'*) _json=${_json#*'"reason": "'} ;;
            *) break ;;
        esac
        case $_json in
            'WarmingUp"'* | 'PodNotInLedger"'* | 'PodDevicesUnknown"'*) _seen=1 ;;
            *) return 1 ;;
        esac
    done
    [ "$_seen" = 1 ]
}

if ! command -v curl >/dev/null 2>&1; then
    warn "curl is not installed in this container: use an image that has it (e.g. curlimages/curl)"
    exit 2
fi
WAIT_SECONDS=${NODE_HEALTH_WAIT_SECONDS:-30}
case $WAIT_SECONDS in
    '' | *[!0-9]*)
        warn "NODE_HEALTH_WAIT_SECONDS must be a whole number of seconds, got '$WAIT_SECONDS'"
        exit 2
        ;;
esac
if [ ${#WAIT_SECONDS} -gt 4 ]; then
    warn "NODE_HEALTH_WAIT_SECONDS must be at most 9999, got '$WAIT_SECONDS'"
    exit 2
fi

QUERY_DEVICES=$(visible_devices)
QUERY_POD=
USE_POD=0
if [ -n "${POD_NAMESPACE:-}" ] && [ -n "${POD_NAME:-}" ]; then
    QUERY_POD=$POD_NAMESPACE/$POD_NAME
    USE_POD=1
fi
CANDIDATES=
if [ -n "${HOST_IP:-}" ] && [ -n "${NODE_HEALTH_HOST_PORT:-}" ]; then
    case $HOST_IP in
        *:*) CANDIDATES="http://[$HOST_IP]:$NODE_HEALTH_HOST_PORT" ;; # IPv6
        *) CANDIDATES="http://$HOST_IP:$NODE_HEALTH_HOST_PORT" ;;
    esac
fi
CANDIDATES="$CANDIDATES ${NODE_HEALTH_URL:-$SERVICE_URL}"

started=$(date +%s)
give_up=$((started + BUDGET_SECONDS)) # while nothing answers
wait_until=$((started + WAIT_SECONDS)) # while the agent answers "warming up" or "overloaded"
tried=                                # attempts without an answer, for the log
overloaded=                           # the last refusal for load
warm_body=                            # the last "warming up" answer, and where it came from
warm_url=
round=1
while :; do
    answered=0
    for base in $CANDIDATES; do
        deadline=$give_up
        if [ -n "$overloaded$warm_url" ] && [ "$wait_until" -gt "$deadline" ]; then deadline=$wait_until; fi
        left=$((deadline - $(date +%s)))
        if [ "$left" -lt 1 ]; then break 2; fi
        max=$ANSWER_SECONDS
        if [ "$left" -lt "$max" ]; then max=$left; fi
        connect=$CONNECT_SECONDS
        if [ "$max" -lt "$connect" ]; then connect=$max; fi
        ask "$base" "$connect" "$max" text/plain
        case $ANSWER_CODE in
            200)
                if says_ready; then
                    say "$ANSWER_URL answered 200"
                    printf '%s\n' "$ANSWER_BODY"
                    exit 0
                fi
                why="answered 200, but not as node-health does: ${ANSWER_BODY%%"$NL"*}"
                ;;
            503 | 429)
                if says_overloaded; then
                    if [ -z "$overloaded" ]; then
                        say "$ANSWER_URL answered $ANSWER_CODE: the agent is overloaded; asking again for up to" \
                            "$((wait_until > give_up ? WAIT_SECONDS : BUDGET_SECONDS)) s"
                    fi
                    overloaded="$ANSWER_URL answered $ANSWER_CODE: ${ANSWER_BODY%%"$NL"*}"
                    answered=1
                    continue
                fi
                if [ "$ANSWER_CODE" = 503 ] && says_not_ready; then
                    WARM_BASE=$base
                    if [ "$USE_POD" = 1 ] && ledger_unusable; then
                        say "$ANSWER_URL answered 503: the agent cannot read the kubelet's ledger for this pod;" \
                            "asking about $(fallback_scope) instead"
                        printf '%s\n' "$ANSWER_BODY"
                        USE_POD=0
                        answered=1
                        break
                    fi
                    still=
                    if [ "$WAIT_SECONDS" -gt 0 ] && warming_up_only; then
                        if [ "$(date +%s)" -lt "$wait_until" ]; then
                            if [ -z "$warm_url" ]; then
                                say "$ANSWER_URL answered 503: $(waiting_for); asking again for up to ${WAIT_SECONDS} s"
                            fi
                            warm_body=$ANSWER_BODY
                            warm_url=$ANSWER_URL
                            answered=1
                            break
                        fi
                        still=" ($(still_waiting) after $(($(date +%s) - started)) s)"
                    fi
                    say "$ANSWER_URL answered 503: this node is not ready for the job$still"
                    printf '%s\n' "$ANSWER_BODY"
                    annotate error "this node is not ready for the job: ${ANSWER_BODY%%"$NL"*} (see Set up runner)"
                    exit 1
                fi
                why="answered HTTP $ANSWER_CODE, but not as node-health does: ${ANSWER_BODY%%"$NL"*}"
                ;;
            400)
                case $USE_POD:$ANSWER_BODY in
                    1:*"unknown parameter 'pod'"*) # an agent older than pod=: the devices, or the whole node
                        say "$ANSWER_URL answered 400: this agent does not know pod= (an older release); asking" \
                            "about $(fallback_scope) instead"
                        USE_POD=0
                        answered=1
                        break
                        ;;
                esac
                say "$ANSWER_URL answered 400: the agent refused the question (check the NODE_HEALTH_* values)"
                printf '%s\n' "$ANSWER_BODY"
                exit 2
                ;;
            000)
                if [ "$CURL_EXIT" -eq 56 ]; then # the agent resets connections it refuses for load
                    overloaded="${ANSWER_URL:-$base/ready}: the connection was reset (refused for load)"
                    answered=1
                    continue
                fi
                why=$(describe_failure "$CURL_EXIT")
                ;;
            *) why="answered HTTP $ANSWER_CODE: ${ANSWER_BODY%%"$NL"*}" ;;
        esac
        tried="$tried$NL  round $round: ${ANSWER_URL:-$base/ready}: $why"
    done
    if [ "$answered" -eq 0 ]; then
        round=$((round + 1))
        if [ "$round" -gt "$ROUNDS" ] && [ -z "$overloaded$warm_url" ]; then break; fi
    fi
    deadline=$give_up
    if [ -n "$overloaded$warm_url" ] && [ "$wait_until" -gt "$deadline" ]; then deadline=$wait_until; fi
    if [ $((deadline - $(date +%s))) -le 1 ]; then break; fi
    sleep 1
done

elapsed=$(($(date +%s) - started))
if [ -n "$warm_url" ]; then
    ANSWER_BODY=$warm_body
    say "$warm_url answered 503: this node is not ready for the job ($(still_waiting) after ${elapsed} s)"
    printf '%s\n' "$warm_body"
    annotate error "this node is not ready for the job: $(still_waiting) after ${elapsed} s (see Set up runner)"
    exit 1
fi
if [ -n "$overloaded" ]; then
    warn "agent overloaded: it refused every attempt for load within ${elapsed} s, so this node's health is" \
        "unknown. Last: $overloaded"
    warn "too many connections to the node-health agent on this node; retry the job, and see the agent's" \
        "nodehealth_http_connections_refused_total"
    annotate error "agent overloaded: no verdict on this node within ${elapsed} s (see Set up runner)"
    exit 4
fi
case ${NODE_HEALTH_FAIL_OPEN:-0} in
    1 | true | yes)
        warn "WARNING: no node-health agent answered within ${elapsed} s; the job starts unchecked" \
            "(NODE_HEALTH_FAIL_OPEN=1). Tried:$tried"
        annotate warning "no node-health agent answered within ${elapsed} s; the job starts unchecked"
        exit 0
        ;;
esac
warn "no node-health agent answered within ${elapsed} s, so this node's health is unknown. Tried:$tried"
warn "is the node-health agent running and ready on this node? (kubectl -n node-health get pods -o wide)"
annotate error "no node-health agent answered within ${elapsed} s (see Set up runner)"
exit 3
