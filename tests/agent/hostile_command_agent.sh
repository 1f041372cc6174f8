#!/bin/sh
# A hostile command agent: it calls the gateway (allowed), then tries to escape its sandbox.
# Its reward is a bitmask of the attempts that were blocked (bit i: attempt i in ATTEMPTS of
# test_command_sandbox.py), so the test can name any that got through.
row=$(cat)
auth="Authorization: Bearer $OPENAI_API_KEY"
curl -sf -H "$auth" "$OPENAI_BASE_URL/models" >/dev/null || { echo "gateway unreachable" >&2; exit 1; }
blocked=0
# 0: another port on this machine (a server the test runs beside the gateway)
curl -sf -m 5 "http://127.0.0.1:$(echo "$row" | jq -r .other_port)/" >/dev/null 2>&1 || blocked=$((blocked + 1))
# 1: write into a folder of the trainer's user
(echo pwned > "$(echo "$row" | jq -r .forbidden_file)") 2>/dev/null || blocked=$((blocked + 2))
# 2: more processes than allowed (bounded, so a broken limit cannot take the machine down)
forks=$(/usr/bin/python3 -c "
import os, signal, time
children = []
for _ in range(40):
    try:
        pid = os.fork()
    except OSError:
        break
    if pid == 0:
        time.sleep(3607)
        os._exit(0)
    children.append(pid)
for pid in children:  # leave room for the next attempts
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
print(len(children))" 2>/dev/null)
[ "${forks:-40}" -lt 40 ] && blocked=$((blocked + 4))
# 3: memory beyond the limit
/usr/bin/python3 -c "bytearray(512 << 20)" 2>&1 | grep -q MemoryError && blocked=$((blocked + 8))
# 4: the trainer's credentials
[ -z "${HF_TOKEN:-}" ] && blocked=$((blocked + 16))
# 5: a daemon that leaves the process group, to outlive the run
setsid sleep 3608 >/dev/null 2>&1 &
sleep 1  # let it detach before the run ends
echo "$blocked"
