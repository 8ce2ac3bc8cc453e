"""Synthetic-data tasks: SELinux, cgroups, systemd, journald, kernel/sysctl, users, SSH.

See :mod:`hivetune.data.synth_topics` for the template format and the answer convention.
"""

from __future__ import annotations

from hivetune.data.synth_topics import (ANY_SERVICES, APP_SERVICES, DATA_DIRS, GROUPS, HOSTS,
                                        MEMORY_SIZES, PIDS, SYSTEM_SERVICES, USERS, WEB_DIRS, task)

# Services that plausibly need resource limits (not, say, chronyd or firewalld).
_HUNGRY_SERVICES = ("nginx", "httpd", "redis", "postgresql") + APP_SERVICES

_WEB_ACCESS = (
    {"ctype": "httpd_sys_content_t", "access": "read", "mode": "read-only"},
    {"ctype": "httpd_sys_rw_content_t", "access": "write", "mode": "read-write"},
)
# Services with the SELinux port type they may bind; the ports are not predefined for that type.
# "bindmsg" is the error each daemon logs when SELinux blocks the bind; it refers to {port}.
_PORT_TYPES = (
    {"svc": "nginx", "ptype": "http_port_t", "bindmsg": "bind() to 0.0.0.0:{port} failed (13: Permission denied)"},
    {"svc": "httpd", "ptype": "http_port_t",
     "bindmsg": "(13)Permission denied: AH00072: make_sock: could not bind to address [::]:{port}"},
    {"svc": "sshd", "ptype": "ssh_port_t", "bindmsg": "error: Bind to port {port} on 0.0.0.0 failed: Permission denied."},
    {"svc": "redis", "ptype": "redis_port_t",
     "bindmsg": "Warning: Could not create server TCP listening socket *:{port}: bind: Permission denied"},
    {"svc": "postgresql", "ptype": "postgresql_port_t",
     "bindmsg": "could not bind IPv4 address \"0.0.0.0\": Permission denied"},
)
_BOOLEANS = (
    {"bool": "httpd_can_network_connect",
     "purpose": "let nginx or httpd proxy requests to a backend service"},
    {"bool": "httpd_can_network_connect_db", "purpose": "let httpd connect to a remote database"},
    {"bool": "httpd_enable_homedirs", "purpose": "let httpd serve content from user home directories"},
    {"bool": "container_use_devices", "purpose": "let containers use host devices such as GPUs"},
    {"bool": "httpd_use_nfs", "purpose": "let httpd serve files stored on an NFS mount"},
    {"bool": "samba_enable_home_dirs", "purpose": "let Samba share user home directories"},
    {"bool": "virt_use_nfs", "purpose": "let virtual machines use disk images stored on NFS"},
)
# Service name -> process name (comm) as the audit log records it.
_AUDITED = (
    {"svc": "nginx", "comm": "nginx"}, {"svc": "httpd", "comm": "httpd"},
    {"svc": "postgresql", "comm": "postgres"}, {"svc": "llama-server", "comm": "llama-server"},
    {"svc": "sshd", "comm": "sshd"}, {"svc": "redis", "comm": "redis-server"},
)

SELINUX = [
    task("selinux.web_content",
         goals=("give {server} {mode} access to {path} under SELinux",
                "label {path} so {server} can {access} it with SELinux enforcing",
                "set a persistent SELinux file context on {path} so {server} gets {mode} access"),
         questions=("{server} gets permission denied when it tries to {access} files in {path} while "
                    "SELinux is enforcing. What should I check?",
                    ("My {server} cannot {access} files in {path}. The audit log shows this. How do I fix it?",
                     "avc:  denied  { {access} } for comm=\"{server}\" name=\"index.html\" "
                     "scontext=system_u:system_r:httpd_t:s0 "
                     "tcontext=unconfined_u:object_r:default_t:s0 tclass=file permissive=0"),
                    "Explain why chcon is not enough to give {server} {mode} access to {path} permanently."),
         answers=("SELinux only lets {server} (domain httpd_t) {access} files with a web content "
                  "type. Add a persistent rule for the directory tree, then relabel what is on disk:\n"
                  "$ sudo semanage fcontext -a -t {ctype} \"{path}(/.*)?\"\n"
                  "$ sudo restorecon -Rv {path}\n"
                  "Verify the new label with:\n$ ls -Zd {path}\n"
                  "Avoid chcon for this: its changes are lost at the next full relabel.",
                  "1. Record a file context rule so it survives relabels:\n"
                  "$ sudo semanage fcontext -a -t {ctype} \"{path}(/.*)?\"\n"
                  "2. Apply it to the existing files:\n$ sudo restorecon -Rv {path}\n"
                  "3. Confirm the files now carry {ctype}:\n$ ls -Z {path}\n"
                  "Use {ctype} for {mode} web content."),
         command="semanage fcontext -a -t {ctype} \"{path}(/.*)?\"",
         slots={"path": WEB_DIRS, "access": _WEB_ACCESS, "server": ("httpd", "nginx")}),
    task("selinux.port",
         goals=("allow {svc} to listen on TCP port {port} with SELinux enforcing",
                "add port {port} to the SELinux policy for {svc}",
                "let {svc} bind to the non-standard port {port} under SELinux"),
         questions=(("{svc} fails to start after I moved it to port {port}. The log shows this error. How do I fix it?",
                     "{bindmsg}"),),
         answers="SELinux only allows {svc} to bind ports labeled {ptype}. Add the new port to "
                 "that type:\n$ sudo semanage port -a -t {ptype} -p tcp {port}\n"
                 "Check it:\n$ sudo semanage port -l | grep {ptype}\n"
                 "If the port is already assigned to another type, use -m instead of -a. Then "
                 "restart the service:\n$ sudo systemctl restart {svc}",
         command="semanage port -a -t {ptype} -p tcp {port}",
         slots={"svc": _PORT_TYPES, "port": ("2222", "5433", "6380", "7070", "8085", "8181", "8880")}),
    task("selinux.boolean",
         goals=("{purpose} without disabling SELinux", "{purpose} using an SELinux boolean"),
         questions=("Which SELinux boolean do I need to {purpose}, and how do I set it?",
                    "Explain how SELinux booleans work, using {bool} as the example."),
         answers=("Use the {bool} boolean. -P makes the change persistent across reboots:\n"
                  "$ sudo setsebool -P {bool} on\nCheck the current value:\n$ getsebool {bool}\n"
                  "semanage boolean -l lists every boolean with a description if you need another one.",
                  "SELinux booleans switch optional parts of the policy on or off without writing "
                  "policy. For this case turn on {bool}:\n$ sudo setsebool -P {bool} on\n"
                  "Without -P the value resets at reboot. Confirm with:\n$ getsebool {bool}"),
         command="setsebool -P {bool} on",
         slots={"bool": _BOOLEANS}),
    task("selinux.denials",
         goals=("find the SELinux denials that blocked {svc} {when}",
                "see the SELinux AVC denials for {svc} {when}",
                "check whether SELinux blocked {svc} {when}"),
         questions=("{svc} failed with permission denied {when} although the file permissions look "
                    "fine. How do I confirm it is SELinux?",),
         answers="Search the audit log for AVC denials from that process:\n"
                 "$ sudo ausearch -m AVC -ts {ts} -c {comm}\n"
                 "Pipe them through audit2why for the reason and a suggested fix:\n"
                 "$ sudo ausearch -m AVC -ts {ts} | audit2why\n"
                 "With setroubleshoot installed, journalctl -t setroubleshoot shows readable "
                 "explanations. Fix labels or booleans rather than disabling SELinux.",
         command="ausearch -m AVC -ts {ts}",
         slots={"svc": _AUDITED, "window": ({"ts": "recent", "when": "in the last few minutes"},
                                            {"ts": "today", "when": "today"},
                                            {"ts": "this-hour", "when": "this hour"},
                                            {"ts": "boot", "when": "since the last boot"})}),
    task("selinux.mode",
         goals=("check whether SELinux is enforcing or permissive",
                "see the current SELinux mode and loaded policy",
                "find out if SELinux is enabled on this machine"),
         questions=("Explain the difference between enforcing and permissive SELinux modes.",),
         answers="$ getenforce\nprints Enforcing, Permissive or Disabled. For details such as "
                 "the loaded policy and the mode set in /etc/selinux/config:\n$ sestatus\n"
                 "Enforcing blocks and logs denials; permissive only logs them, which is useful "
                 "for debugging but gives no protection.",
         command="getenforce"),
    task("selinux.permissive",
         goals=("debug {domain} denials without putting all of SELinux in permissive mode",
                "make only the {domain} domain permissive while I debug it"),
         questions=("Should I disable SELinux to fix a permission problem with {domain}? "
                    "What should I do instead?",),
         answers="Don't disable it. For a short test switch to permissive until the next reboot:\n"
                 "$ sudo setenforce 0\nand back with sudo setenforce 1. Narrower still, make "
                 "just one domain permissive:\n$ sudo semanage permissive -a {domain}\n"
                 "Denials are still logged, so collect them with ausearch -m AVC, fix the "
                 "label or boolean, then remove it with semanage permissive -d {domain}.",
         command="semanage permissive -a {domain}",
         slots={"domain": ("httpd_t", "container_t", "postgresql_t", "sshd_t", "init_t")}),
    task("selinux.custom_module",
         goals=("build a local SELinux policy module from the denials of {comm}",
                "allow the actions {comm} is denied with a custom SELinux module"),
         questions=("Explain how audit2allow turns SELinux denials for {comm} into a policy module.",),
         answers="After confirming the denials are expected behavior, generate a module from them:\n"
                 "$ sudo ausearch -c '{comm}' --raw | audit2allow -M my-{comm}\n"
                 "Review my-{comm}.te, then load the compiled module:\n"
                 "$ sudo semodule -i my-{comm}.pp\n"
                 "Prefer a boolean or file label when one fits: custom modules easily allow too much.",
         command="audit2allow -M my-{comm}",
         slots={"comm": ("nginx", "httpd", "llama-server", "myapp", "gunicorn", "node")}),
    task("selinux.restorecon",
         goals=("fix the SELinux labels after moving files into {path}",
                "reset the SELinux contexts of everything under {path}"),
         questions=("I moved files into {path} with mv and now {server} gets permission denied. Why?",),
         answers="mv keeps the original SELinux label (for example user_home_t), while cp gives "
                 "new files the label of the target directory. Reset the labels to the policy "
                 "defaults:\n$ sudo restorecon -Rv {path}\nCheck the result with ls -Z {path}. "
                 "If the defaults are wrong for that path, add a rule with semanage fcontext first.",
         command="restorecon -Rv {path}",
         slots={"path": WEB_DIRS + DATA_DIRS, "server": ("httpd", "nginx", "the service")}),
]

_CPU_QUOTAS = (
    {"pct": "50%", "cores": "half of one CPU core"}, {"pct": "100%", "cores": "one CPU core"},
    {"pct": "150%", "cores": "one and a half CPU cores"}, {"pct": "200%", "cores": "two CPU cores"},
    {"pct": "400%", "cores": "four CPU cores"},
)
_COMMANDS = ("python train.py", "make -j8", "./benchmark.sh", "python -m pytest",
             "ffmpeg -i input.mp4 output.webm", "npm run build")

CGROUPS = [
    task("cgroups.memory_limit",
         goals=("limit {svc} to {mem} of memory with systemd", "cap the memory of the {svc} service at {mem}",
                "stop {svc} from using more than {mem} of RAM"),
         questions=("My {svc} service keeps eating all the RAM. How do I put a hard {mem} limit on it?",),
         answers=("systemd runs every service in its own cgroup, so set the limit as a unit property:\n"
                  "$ sudo systemctl set-property {svc}.service MemoryMax={mem}\n"
                  "This writes a persistent drop-in and applies at once (add --runtime for a "
                  "temporary change). Check it:\n$ systemctl show {svc}.service -p MemoryMax\n"
                  "Above the limit the kernel OOM-kills inside that cgroup only. MemoryHigh "
                  "throttles and reclaims instead of killing.",
                  "1. Set the hard limit:\n$ sudo systemctl set-property {svc}.service MemoryMax={mem}\n"
                  "2. Confirm it is active:\n$ systemctl show {svc}.service -p MemoryMax\n"
                  "3. Watch the usage:\n$ systemd-cgtop -m\n"
                  "set-property persists the setting in /etc/systemd/system.control/."),
         command="systemctl set-property {svc}.service MemoryMax={mem}",
         slots={"svc": _HUNGRY_SERVICES, "mem": MEMORY_SIZES}),
    task("cgroups.cpu_quota",
         goals=("limit {svc} to {cores} with a CPU quota", "restrict the {svc} service to {cores}",
                "set a CPUQuota of {pct} on {svc}"),
         answers="CPUQuota is relative to one CPU, so {pct} means {cores}:\n"
                 "$ sudo systemctl set-property {svc}.service CPUQuota={pct}\n"
                 "Verify it:\n$ systemctl show {svc}.service -p CPUQuotaPerSecUSec\n"
                 "For a relative share instead of a hard cap, set CPUWeight (default 100).",
         command="systemctl set-property {svc}.service CPUQuota={pct}",
         slots={"svc": _HUNGRY_SERVICES, "quota": _CPU_QUOTAS}),
    task("cgroups.transient_scope",
         goals=("run {cmd} with a {mem} memory limit and a {pct} CPU quota",
                "start {cmd} in its own cgroup limited to {mem} of memory and {cores}",
                "run a one-off command like {cmd} capped at {mem} of RAM and {pct} CPU"),
         answers="systemd-run creates a transient scope with its own cgroup, so the limits apply "
                 "only to that command and its children:\n"
                 "$ sudo systemd-run --scope -p MemoryMax={mem} -p CPUQuota={pct} {cmd}\n"
                 "As a normal user use systemd-run --user --scope with the same -p options; "
                 "Fedora delegates the memory and cpu controllers to user sessions by default.",
         command="systemd-run --scope -p MemoryMax={mem} -p CPUQuota={pct} {cmd}",
         slots={"cmd": _COMMANDS, "mem": MEMORY_SIZES, "quota": _CPU_QUOTAS}),
    task("cgroups.top",
         goals=("see which cgroups use the most memory right now", "view live resource usage per systemd service",
                "find the service that uses the most memory"),
         answers="systemd-cgtop is a top-like view of every cgroup; -m sorts by memory:\n"
                 "$ systemd-cgtop -m\nPress c, m or i to sort by CPU, memory or I/O while it "
                 "runs. To see which processes sit in which unit:\n$ systemd-cgls",
         command="systemd-cgtop -m"),
    task("cgroups.process",
         goals=("find which cgroup process {pid} belongs to", "check which systemd unit owns PID {pid}"),
         answers="$ cat /proc/{pid}/cgroup\nOn cgroup v2 this prints one line such as "
                 "0::/system.slice/nginx.service. systemctl maps a PID to its unit directly:\n"
                 "$ systemctl status {pid}\nand systemd-cgls shows the whole tree.",
         command="cat /proc/{pid}/cgroup",
         slots={"pid": PIDS}),
    task("cgroups.version",
         goals=("check whether this system uses cgroup v1 or v2", "find out which cgroup version my machine runs",
                "confirm that the unified cgroup v2 hierarchy is enabled"),
         answers="$ stat -fc %T /sys/fs/cgroup/\ncgroup2fs means the unified cgroup v2 "
                 "hierarchy (the default on current Fedora); tmpfs means the legacy v1 layout. "
                 "On v2 the available controllers are listed in:\n"
                 "$ cat /sys/fs/cgroup/cgroup.controllers",
         command="stat -fc %T /sys/fs/cgroup/"),
    task("cgroups.podman",
         goals=("run the container {name} from {image} with a {mem} memory limit and {cpus} CPUs",
                "limit the podman container {name} running {image} to {mem} of memory and {cpus} CPUs"),
         answers="Podman writes the limits into the container's cgroup:\n"
                 "$ podman run -d --name {name} --memory {mem} --cpus {cpus} {image}\n"
                 "Check that they apply:\n$ podman stats --no-stream {name}\n"
                 "Rootless containers need the memory and cpu controllers delegated to your "
                 "user, which Fedora does by default.",
         command="podman run -d --name {name} --memory {mem} --cpus {cpus} {image}",
         slots={"name": ("web", "cache", "proxy", "api"), "mem": ("512m", "1g", "2g", "4g"),
                "cpus": ("0.5", "1", "2", "4"),
                "image": ("docker.io/library/nginx:latest", "docker.io/library/redis:7",
                          "docker.io/library/httpd:2.4", "docker.io/library/memcached:latest")}),
    task("cgroups.io_weight",
         goals=("give {svc} a lower disk I/O priority with an IOWeight of {weight}",
                "stop {svc} from starving other services of disk bandwidth by setting IOWeight={weight}"),
         answers="$ sudo systemctl set-property {svc}.service IOWeight={weight}\n"
                 "IOWeight ranges from 1 to 10000 with a default of 100, so {weight} gives it a "
                 "smaller share only when the disk is contended. It needs an I/O scheduler "
                 "that supports weights, such as BFQ. Check with systemctl show {svc}.service -p IOWeight.",
         command="systemctl set-property {svc}.service IOWeight={weight}",
         slots={"svc": ("backup-agent", "restic-backup", "indexer", "model-sync"),
                "weight": ("10", "20", "50")}),
]

_APP_UNITS = (
    {"unit": "llama-server", "desc": "llama.cpp inference server", "user": "llm",
     "exec": "/usr/local/bin/llama-server -m /srv/models/model.gguf --port 8080"},
    {"unit": "inference-api", "desc": "Python inference API", "user": "mlops",
     "exec": "/opt/inference/venv/bin/python -m inference_api"},
    {"unit": "metrics-agent", "desc": "metrics agent", "user": "metrics",
     "exec": "/usr/local/bin/metrics-agent"},
    {"unit": "jupyter", "desc": "JupyterLab server", "user": "alice",
     "exec": "/opt/jupyter/venv/bin/jupyter lab --no-browser --port 8888"},
    {"unit": "vllm", "desc": "vLLM OpenAI-compatible server", "user": "llm",
     "exec": "/opt/vllm/venv/bin/vllm serve Qwen/Qwen2.5-7B-Instruct --port 8000"},
    {"unit": "webhook-receiver", "desc": "webhook receiver", "user": "deploy",
     "exec": "/usr/local/bin/webhook-receiver"},
)
_ENV_VARS = ({"var": "OMP_NUM_THREADS", "val": "8"}, {"var": "HF_HOME", "val": "/srv/hf-cache"},
             {"var": "CUDA_VISIBLE_DEVICES", "val": "0"}, {"var": "LOG_LEVEL", "val": "debug"})
_CALENDARS = (
    {"cal": "*-*-* 02:30:00", "when": "night at 02:30"}, {"cal": "hourly", "when": "hour"},
    {"cal": "Mon *-*-* 03:00:00", "when": "Monday at 03:00"}, {"cal": "daily", "when": "day"},
    {"cal": "*:0/15", "when": "15 minutes"},
)
_JOBS = (
    {"name": "db-backup", "job": "a database backup", "exec": "/usr/local/bin/db-backup.sh"},
    {"name": "model-sync", "job": "a model sync script", "exec": "/usr/local/bin/sync-models.sh"},
    {"name": "cleanup-cache", "job": "a cache cleanup job", "exec": "/usr/local/bin/cleanup-cache.sh"},
    {"name": "report", "job": "a report generator", "exec": "/usr/local/bin/make-report.sh"},
)

SYSTEMD = [
    task("systemd.enable_now",
         goals=("start {svc} now and also enable it at boot", "make {svc} start automatically on every boot",
                "enable and start the {svc} service in one step"),
         answers="$ sudo systemctl enable --now {svc}\nenable creates the symlinks that start "
                 "the unit at boot, and --now starts it immediately as well. Check both:\n"
                 "$ systemctl is-enabled {svc}\n$ systemctl status {svc}",
         command="systemctl enable --now {svc}",
         slots={"svc": SYSTEM_SERVICES}),
    task("systemd.restart",
         goals=("restart {svc} and confirm that it came back up", "apply a config change to {svc} by restarting it"),
         answers="$ sudo systemctl restart {svc}\n$ systemctl status {svc}\nstatus shows whether "
                 "it is active, its main PID and the last log lines. Many daemons can reload "
                 "their configuration without a restart: try sudo systemctl reload {svc}.",
         command="systemctl restart {svc}",
         slots={"svc": ANY_SERVICES}),
    task("systemd.create_unit",
         goals=("create a systemd service for my {desc}", "run my {desc} as a systemd service that restarts on failure"),
         questions=("Write a minimal systemd unit that starts {exec} as user {user} at boot.",),
         answers="Create /etc/systemd/system/{unit}.service:\n[Unit]\nDescription={desc}\n"
                 "After=network-online.target\nWants=network-online.target\n\n[Service]\n"
                 "ExecStart={exec}\nUser={user}\nRestart=on-failure\n\n[Install]\n"
                 "WantedBy=multi-user.target\n\nThen load and start it:\n"
                 "$ sudo systemctl daemon-reload\n$ sudo systemctl enable --now {unit}",
         command="systemctl enable --now {unit}",
         slots={"app": _APP_UNITS}),
    task("systemd.drop_in",
         goals=("set the environment variable {var} for the {unit} service",
                "override a setting of {unit} without editing its unit file"),
         answers="Use a drop-in instead of editing the unit file:\n$ sudo systemctl edit {unit}\n"
                 "In the editor add:\n[Service]\nEnvironment={var}={val}\n"
                 "systemctl edit reloads the configuration when you save; then restart:\n"
                 "$ sudo systemctl restart {unit}\n"
                 "The override lives in /etc/systemd/system/{unit}.service.d/override.conf.",
         command="systemctl edit {unit}",
         slots={"app": _APP_UNITS, "env": _ENV_VARS}),
    task("systemd.failed",
         goals=("list all systemd units that failed", "find which services failed during boot"),
         answers="$ systemctl --failed\nThen inspect one of them, for example {svc}:\n"
                 "$ systemctl status {svc}\n$ journalctl -b -u {svc}\n"
                 "After fixing the cause, clear the failed state with sudo systemctl reset-failed {svc}.",
         command="systemctl --failed",
         slots={"svc": ANY_SERVICES}),
    task("systemd.timer",
         goals=("run {job} every {when} with a systemd timer", "replace a cron entry for {job} with a systemd timer"),
         answers="Create /etc/systemd/system/{name}.service with Type=oneshot and "
                 "ExecStart={exec}, then /etc/systemd/system/{name}.timer:\n[Timer]\n"
                 "OnCalendar={cal}\nPersistent=true\n\n[Install]\nWantedBy=timers.target\n\n"
                 "Enable the timer, not the service:\n$ sudo systemctl enable --now {name}.timer\n"
                 "$ systemctl list-timers {name}.timer\n"
                 "Check the schedule with systemd-analyze calendar '{cal}'.",
         command="systemctl enable --now {name}.timer",
         slots={"job_": _JOBS, "calendar": _CALENDARS}),
    task("systemd.user_service",
         goals=("keep the user service {unit} of {user} running after they log out",
                "start a systemd user service for {user} at boot without a login"),
         answers="Put the unit in ~/.config/systemd/user/{unit}.service with "
                 "WantedBy=default.target, then:\n$ systemctl --user daemon-reload\n"
                 "$ systemctl --user enable --now {unit}\nUser services stop when the last "
                 "session ends unless lingering is enabled:\n$ sudo loginctl enable-linger {user}",
         command="loginctl enable-linger {user}",
         slots={"unit": APP_SERVICES, "user": USERS}),
    task("systemd.boot_time",
         goals=("find which services slow down the boot", "analyze why my Fedora machine boots slowly"),
         answers="$ systemd-analyze\nshows the total time split into firmware, loader, kernel, "
                 "initrd and userspace.\n$ systemd-analyze blame\nlists units by start-up time, and\n"
                 "$ systemd-analyze critical-chain\nshows the chain that actually delayed the "
                 "default target. A slow unit in blame is not always on the critical path.",
         command="systemd-analyze blame"),
    task("systemd.mask",
         goals=("prevent {svc} from ever being started", "completely disable {svc} so nothing can start it"),
         answers="disable only removes the boot-time symlinks; another unit or a socket can "
                 "still start the service. mask links it to /dev/null, and --now also stops it:\n"
                 "$ sudo systemctl mask --now {svc}\nUndo with sudo systemctl unmask {svc}.",
         command="systemctl mask --now {svc}",
         slots={"svc": ("packagekit", "bluetooth", "cups", "ModemManager", "avahi-daemon")}),
]

_SINCE = (
    {"since": "1 hour ago", "phrase": "from the last hour"},
    {"since": "30 min ago", "phrase": "from the last 30 minutes"},
    {"since": "today", "phrase": "from today"}, {"since": "yesterday", "phrase": "since yesterday"},
    {"since": "2 hours ago", "phrase": "from the last two hours"},
    {"since": "10 min ago", "phrase": "from the last 10 minutes"},
)
_PRIORITIES = ({"p": "err", "label": "errors"}, {"p": "warning", "label": "warnings and errors"},
               {"p": "crit", "label": "critical messages"})
_BOOTS = ({"b": "-b", "scope": "the current boot"}, {"b": "-b -1", "scope": "the previous boot"})

JOURNALD = [
    task("journald.unit_since",
         goals=("show the {svc} logs {phrase}", "read the journal of {svc} {phrase}"),
         questions=("Something went wrong with {svc}. How do I see only its log messages {phrase}?",),
         answers=("$ journalctl -u {svc} --since \"{since}\"\n-u filters by unit and --since "
                  "takes relative times like \"1 hour ago\" or absolute ones like "
                  "\"2024-06-01 08:00\". Add --until to close the window, -p warning to hide "
                  "informational messages and --no-pager when piping the output.",
                  "Filter the journal by unit and time:\n$ journalctl -u {svc} --since \"{since}\"\n"
                  "Add -f to keep following new lines, -o short-iso for sortable timestamps, and "
                  "-p err to see only errors. Use journalctl --list-boots to pick a boot with -b."),
         command="journalctl -u {svc} --since \"{since}\"",
         slots={"svc": ANY_SERVICES, "window": _SINCE}),
    task("journald.follow",
         goals=("follow the logs of {svc} live", "watch new log lines from {svc} as they arrive",
                "tail the {svc} journal like tail -f"),
         answers="$ journalctl -u {svc} -f\n-f prints the last 10 lines and then follows new "
                 "entries until you press Ctrl+C. Use -n 100 to start with more history, and "
                 "repeat -u to follow several units together.",
         command="journalctl -u {svc} -f",
         slots={"svc": ANY_SERVICES}),
    task("journald.priority",
         goals=("show only {label} from {scope}", "list the {label} logged during {scope}"),
         answers="$ journalctl -p {p} {b}\n-p {p} shows that priority and every more severe "
                 "level. -b alone means the current boot and -b -1 the previous one; "
                 "journalctl --list-boots lists all recorded boots.",
         command="journalctl -p {p} {b}",
         slots={"prio": _PRIORITIES, "boot": _BOOTS}),
    task("journald.previous_boot",
         goals=("read the logs from the previous boot after a crash", "see what happened right before the last reboot"),
         questions=("My machine froze and I had to power it off. How do I find out what happened?",),
         answers="$ journalctl --list-boots\n$ journalctl -b -1 -e\n-b -1 selects the previous "
                 "boot and -e jumps to its end, where a crash or hang shows up. Add -k for kernel "
                 "messages only. This needs a persistent journal in /var/log/journal, which "
                 "Fedora has by default.",
         command="journalctl -b -1 -e"),
    task("journald.vacuum",
         goals=("shrink the systemd journal to {size}", "free the disk space of old journal logs, keeping at most {size}",
                "limit the journal to {size} permanently"),
         answers="Check how much space it uses:\n$ journalctl --disk-usage\nRemove archived "
                 "logs until the total is below {size}:\n$ sudo journalctl --vacuum-size={size}\n"
                 "or by age with --vacuum-time={age}. To keep it that way set SystemMaxUse={size} "
                 "in /etc/systemd/journald.conf and restart systemd-journald.",
         command="journalctl --vacuum-size={size}",
         slots={"size": ("200M", "500M", "1G", "2G"), "age": ("2weeks", "10d", "1month")}),
    task("journald.grep",
         goals=("search the {svc} logs for \"{pattern}\"", "find log lines containing \"{pattern}\" for {svc}"),
         answers="$ journalctl -u {svc} -g \"{pattern}\"\n-g (--grep) filters messages with a "
                 "regular expression; matching ignores case when the pattern is all lower case. "
                 "Combine it with --since today or -b to limit the time range.",
         command="journalctl -u {svc} -g \"{pattern}\"",
         slots={"svc": ANY_SERVICES, "pattern": ("timeout", "out of memory", "connection refused",
                                                 "segfault", "permission denied")}),
    task("journald.kernel",
         goals=("see only the kernel messages of the current boot", "check the kernel log for {driver} errors"),
         answers="$ journalctl -k -b\n-k shows only kernel messages (like dmesg) and -b limits "
                 "them to the current boot. Narrow it to one driver with -g:\n"
                 "$ journalctl -k -b -g {driver}",
         command="journalctl -k -b",
         slots={"driver": ("amdgpu", "nvidia", "nvme", "i915", "xfs", "btrfs")}),
    task("journald.context",
         goals=("see the log lines around the last failure of {svc}",),
         questions=(("The journal shows this for {svc}. How do I see what happened right before it?",
                     "{svc}.service: Main process exited, code=exited, status=1/FAILURE"),
                    ("systemctl status {svc} only shows this. Where is the rest of the log?",
                     "{svc}.service: Failed with result 'exit-code'.")),
         answers="status shows only the last few lines. Open the whole log of this boot and jump "
                 "to the end, where the failure is:\n$ journalctl -u {svc} -b -e\n-x adds "
                 "explanatory help texts to some messages. The lines just before the exit usually "
                 "name the cause, such as a config error or a missing file.",
         command="journalctl -u {svc} -b -e",
         slots={"svc": ANY_SERVICES}),
    task("journald.json",
         goals=("export the last {n} log entries of {svc} as JSON",
                "get the last {n} entries of the {svc} journal in a machine-readable format"),
         answers="$ journalctl -u {svc} -n {n} -o json-pretty\nFor one object per line, which "
                 "is easier to feed to jq, use -o json:\n"
                 "$ journalctl -u {svc} -n {n} -o json | jq -r .MESSAGE",
         command="journalctl -u {svc} -n {n} -o json-pretty",
         slots={"svc": ANY_SERVICES, "n": ("20", "50", "100")}),
]

_SYSCTLS = (
    {"key": "vm.swappiness", "val": "10", "file": "99-swappiness.conf",
     "why": "make the kernel swap less eagerly"},
    {"key": "net.core.somaxconn", "val": "4096", "file": "99-somaxconn.conf",
     "why": "allow a longer listen backlog on a busy server"},
    {"key": "vm.max_map_count", "val": "262144", "file": "99-max-map-count.conf",
     "why": "allow more memory map areas for Elasticsearch"},
    {"key": "net.ipv4.ip_forward", "val": "1", "file": "99-ip-forward.conf",
     "why": "enable IPv4 forwarding so the host can route"},
    {"key": "fs.inotify.max_user_watches", "val": "524288", "file": "99-inotify.conf",
     "why": "raise the inotify watch limit for file watchers"},
    {"key": "vm.overcommit_memory", "val": "1", "file": "99-overcommit.conf",
     "why": "allow memory overcommit as Redis recommends"},
)
_MODULES = ("amdgpu", "nvidia", "kvm_amd", "br_netfilter", "wireguard", "vfio_pci")
_KARGS = ("iommu=pt", "intel_iommu=on", "nvidia-drm.modeset=1", "transparent_hugepage=never",
          "mitigations=auto", "amdgpu.ppfeaturemask=0xffffffff")

KERNEL_SYSCTL = [
    task("kernel_sysctl.persist",
         goals=("set {key} to {val} permanently", "{why} and keep the setting after a reboot",
                "make the sysctl {key}={val} persistent"),
         answers="Put the setting in a file under /etc/sysctl.d, which is applied at every boot:\n"
                 "$ echo '{key} = {val}' | sudo tee /etc/sysctl.d/{file}\n"
                 "Load all sysctl files now:\n$ sudo sysctl --system\n"
                 "Check the live value:\n$ sysctl {key}",
         command="echo '{key} = {val}' | sudo tee /etc/sysctl.d/{file}",
         slots={"setting": _SYSCTLS}),
    task("kernel_sysctl.runtime",
         goals=("change {key} to {val} only until the next reboot", "test a new value for {key} without making it permanent"),
         answers="$ sudo sysctl -w {key}={val}\nThe change is live immediately and lost at reboot, "
                 "which makes it safe for testing. Read it back with sysctl {key}; if it helps, "
                 "persist it in a file under /etc/sysctl.d/.",
         command="sysctl -w {key}={val}",
         slots={"setting": _SYSCTLS}),
    task("kernel_sysctl.modules",
         goals=("check whether the {mod} kernel module is loaded", "load the {mod} module and look at its parameters"),
         answers="$ lsmod | grep {mod}\nNo output means it is not loaded. Load it and show its "
                 "version and parameters:\n$ sudo modprobe {mod}\n$ modinfo {mod}\n"
                 "To load it at every boot, put {mod} on a line in /etc/modules-load.d/{mod}.conf.",
         command="lsmod | grep {mod}",
         slots={"mod": _MODULES}),
    task("kernel_sysctl.blacklist",
         goals=("blacklist the {mod} kernel module so I can {why}", "stop the {mod} module from loading at boot"),
         answers="Create /etc/modprobe.d/blacklist-{mod}.conf containing:\nblacklist {mod}\n"
                 "Rebuild the initramfs so it is not loaded early either:\n$ sudo dracut --force\n"
                 "On Fedora Atomic use a kernel argument instead:\n"
                 "$ sudo rpm-ostree kargs --append=modprobe.blacklist={mod}\n"
                 "Reboot and confirm with lsmod | grep {mod}.",
         command="dracut --force",
         slots={"module": ({"mod": "nouveau", "why": "use the proprietary NVIDIA driver"},
                           {"mod": "pcspkr", "why": "silence the PC speaker"},
                           {"mod": "uvcvideo", "why": "disable the built-in webcam"})}),
    task("kernel_sysctl.cmdline",
         goals=("add the kernel argument {karg} on Fedora Workstation", "set {karg} on the kernel command line persistently"),
         answers="On a dnf-based Fedora install use grubby to update every installed kernel:\n"
                 "$ sudo grubby --update-kernel=ALL --args=\"{karg}\"\nReboot and verify:\n"
                 "$ cat /proc/cmdline\nOn Fedora Atomic desktops use "
                 "sudo rpm-ostree kargs --append={karg} instead.",
         command="grubby --update-kernel=ALL --args=\"{karg}\"",
         slots={"karg": _KARGS}),
    task("kernel_sysctl.dmesg",
         goals=("show recent kernel errors and warnings with readable timestamps",
                "read the kernel ring buffer with human-readable times"),
         questions=("My {device} keeps disconnecting. How do I see what the kernel says about it?",),
         answers="$ sudo dmesg -T --level=err,warn\n-T prints wall-clock timestamps; add -w to "
                 "follow new messages live while you reproduce the problem. journalctl -k -b "
                 "shows the same messages from the journal and also covers earlier boots.",
         command="dmesg -T --level=err,warn",
         slots={"device": ("USB drive", "NVMe disk", "GPU", "network card", "Thunderbolt dock")}),
    task("kernel_sysctl.version",
         goals=("check which kernel version is running", "compare the running kernel with the installed kernels"),
         answers="$ uname -r\nprints the running kernel release. The installed kernel packages are:\n"
                 "$ rpm -q kernel\nIf the newest one is not running, you have not rebooted since "
                 "the update. On Fedora Atomic, rpm-ostree status shows the kernel per deployment.",
         command="uname -r"),
    task("kernel_sysctl.hugepages",
         goals=("reserve {n} huge pages for a database or VM", "set up {n} static huge pages and check them"),
         answers="$ sudo sysctl -w vm.nr_hugepages={n}\nWith 2 MiB pages that reserves {mb} MiB. "
                 "Make it persistent with vm.nr_hugepages = {n} in a file under /etc/sysctl.d/, "
                 "and check the result:\n$ grep Huge /proc/meminfo",
         command="sysctl -w vm.nr_hugepages={n}",
         slots={"pages": ({"n": "512", "mb": "1024"}, {"n": "1024", "mb": "2048"},
                          {"n": "2048", "mb": "4096"})}),
]

_MODES = (
    {"mode": "750", "meaning": "the owner has full access, the group may read and enter, others nothing"},
    {"mode": "770", "meaning": "owner and group have full access, others nothing"},
    {"mode": "755", "meaning": "everyone may read and enter, only the owner may write"},
)
_ACL_PERMS = ({"perm": "rwx", "desc": "read and write"}, {"perm": "rx", "desc": "read-only"})

USERS_PERMISSIONS = [
    task("users_permissions.create",
         goals=("create the user {user} with a home directory and add them to {group}",
                "add a new account {user} that belongs to the {group} group"),
         answers="$ sudo useradd -m -G {group} {user}\n$ sudo passwd {user}\n-m creates "
                 "/home/{user} and -G sets supplementary groups; the group must exist (create it "
                 "with sudo groupadd {group}). Check the result:\n$ id {user}",
         command="useradd -m -G {group} {user}",
         slots={"user": USERS, "group": GROUPS}),
    task("users_permissions.add_group",
         goals=("add {user} to the {group} group", "give {user} membership in {group} without removing other groups"),
         answers="$ sudo usermod -aG {group} {user}\n-a is essential: without it -G replaces all "
                 "supplementary groups. The user must log out and back in (or run newgrp {group}) "
                 "before it applies. Verify:\n$ id {user}",
         command="usermod -aG {group} {user}",
         slots={"user": USERS, "group": GROUPS}),
    task("users_permissions.sudo",
         goals=("give {user} administrator rights with sudo", "let {user} run commands with sudo on Fedora"),
         questions=(("sudo refuses to work for {user} and prints this. How do I give them sudo rights?",
                     "{user} is not in the sudoers file."),),
         answers="On Fedora members of the wheel group may use sudo:\n$ sudo usermod -aG wheel {user}\n"
                 "It takes effect at the next login. Check what {user} may run:\n$ sudo -l -U {user}",
         command="usermod -aG wheel {user}",
         slots={"user": USERS}),
    task("users_permissions.sudoers",
         goals=("let {user} restart {svc} with sudo but nothing else",
                "allow {user} to run systemctl restart {svc} without a password"),
         answers="Create a drop-in with visudo, which checks the syntax before saving:\n"
                 "$ sudo visudo -f /etc/sudoers.d/{user}-{svc}\nAdd the line:\n"
                 "{user} ALL=(root) NOPASSWD: /usr/bin/systemctl restart {svc}\n"
                 "Now {user} can run exactly sudo systemctl restart {svc}. Test it:\n$ sudo -l -U {user}",
         command="visudo -f /etc/sudoers.d/{user}-{svc}",
         slots={"user": USERS, "svc": ANY_SERVICES}),
    task("users_permissions.ownership",
         goals=("make {user}:{group} the owner of {path} and set its permissions to {mode}",
                "change the owner of {path} recursively to {user}:{group}"),
         answers="$ sudo chown -R {user}:{group} {path}\n$ sudo chmod {mode} {path}\n"
                 "Mode {mode} means {meaning}. Be careful with chmod -R: it gives files and "
                 "directories the same mode. Check the result with ls -ld {path}.",
         command="chown -R {user}:{group} {path}",
         slots={"user": USERS, "group": GROUPS, "path": DATA_DIRS, "perm": _MODES}),
    task("users_permissions.acl",
         goals=("give {user} {desc} access to {path} without changing its owner",
                "grant {user} {desc} access to {path} with an ACL"),
         answers="Use a POSIX ACL:\n$ sudo setfacl -R -m u:{user}:{perm} {path}\n"
                 "Add a default ACL so new files inside inherit it:\n"
                 "$ sudo setfacl -d -m u:{user}:{perm} {path}\n"
                 "Inspect the result with getfacl {path}; ls -l shows a + after the mode.",
         command="setfacl -R -m u:{user}:{perm} {path}",
         slots={"user": USERS, "acl": _ACL_PERMS, "path": DATA_DIRS}),
    task("users_permissions.shared_dir",
         goals=("set up {path} as a shared directory for the {group} group",
                "make files created in {path} belong to the {group} group automatically"),
         answers="$ sudo chgrp {group} {path}\n$ sudo chmod 2775 {path}\nThe leading 2 is the "
                 "setgid bit: new files and directories inside inherit the {group} group, so the "
                 "whole team can work on them. Members also need umask 002 for group write access.",
         command="chmod 2775 {path}",
         slots={"group": GROUPS, "path": DATA_DIRS}),
    task("users_permissions.lock",
         goals=("lock the account of {user} who left the team", "disable logins for {user} without deleting their files"),
         answers="$ sudo usermod -L -e 1 {user}\n-L locks the password and -e 1 expires the "
                 "account, which also blocks SSH key logins. Check it:\n$ sudo chage -l {user}\n"
                 "Unlock later with sudo usermod -U -e \"\" {user}.",
         command="usermod -L -e 1 {user}",
         slots={"user": USERS}),
    task("users_permissions.delete",
         goals=("remove the user {user} together with their home directory",
                "delete the account {user} and clean up their files"),
         answers="First list files they own outside their home directory:\n"
                 "$ sudo find / -xdev -user {user}\nThen remove the account, home directory "
                 "and mail spool:\n$ sudo userdel -r {user}\n"
                 "Files elsewhere keep the numeric UID; find / -xdev -nouser finds them later.",
         command="userdel -r {user}",
         slots={"user": USERS}),
]

_FORWARDS = (
    {"rport": "8888", "what": "Jupyter"}, {"rport": "8080", "what": "llama-server"},
    {"rport": "8000", "what": "vLLM"}, {"rport": "3000", "what": "Grafana"},
    {"rport": "9090", "what": "Cockpit"}, {"rport": "6006", "what": "TensorBoard"},
)
_KEYS = ("id_ed25519", "id_ed25519_work", "id_lab")

SSH = [
    task("ssh.keygen",
         goals=("set up SSH key login to {user}@{host}", "generate an ed25519 key and copy it to {user}@{host}",
                "stop typing my password when I ssh to {host} as {user}"),
         answers="1. Create a key pair (accept the default path, set a passphrase):\n"
                 "$ ssh-keygen -t ed25519 -C \"{user}@example.com\"\n"
                 "2. Install the public key on the server:\n$ ssh-copy-id {user}@{host}\n"
                 "3. Log in; it should no longer ask for the account password:\n$ ssh {user}@{host}",
         command="ssh-copy-id {user}@{host}",
         slots={"user": USERS, "host": HOSTS},
         brief="$ ssh-copy-id {user}@{host}\n"
               "It installs your public key on the server; create a key pair first with ssh-keygen -t ed25519 "
               "if you have none."),
    task("ssh.harden",
         goals=("disable password logins for SSH on my server", "only allow key-based SSH logins on Fedora",
                "stop root from logging in over SSH"),
         answers="Create /etc/ssh/sshd_config.d/10-hardening.conf with:\nPasswordAuthentication no\n"
                 "PermitRootLogin no\nsshd keeps the first value it reads, so a low number makes "
                 "this file win over later drop-ins. Test the config, then reload:\n"
                 "$ sudo sshd -t\n$ sudo systemctl reload sshd\n"
                 "Keep your session open until a new key-based login works.",
         command="systemctl reload sshd",
         brief="$ sudo systemctl reload sshd\n"
               "Reload after setting PasswordAuthentication no and PermitRootLogin no in "
               "/etc/ssh/sshd_config.d/10-hardening.conf and checking it with sudo sshd -t."),
    task("ssh.local_forward",
         goals=("reach {what} on port {rport} of {host} from my laptop, logging in as {user}",
                "forward local port {rport} to {what} on {host} over SSH as user {user}"),
         answers="Use a local port forward:\n$ ssh -N -L {rport}:localhost:{rport} {user}@{host}\n"
                 "then open http://localhost:{rport} on your laptop. -N skips the remote shell. "
                 "localhost is resolved on {host}, so {what} can keep listening on 127.0.0.1 "
                 "and is never exposed to the network.",
         command="ssh -N -L {rport}:localhost:{rport} {user}@{host}",
         slots={"fwd": _FORWARDS, "user": USERS, "host": HOSTS}),
    task("ssh.jump",
         goals=("ssh to {host} as {user} through the jump host {bastion}",
                "reach {host} via the bastion {bastion} with the account {user}"),
         answers="$ ssh -J {user}@{bastion} {user}@{host}\nTo make it permanent add to "
                 "~/.ssh/config:\nHost {host}\n    ProxyJump {user}@{bastion}\n    User {user}\n"
                 "After that a plain ssh {host} goes through the bastion.",
         command="ssh -J {user}@{bastion} {user}@{host}",
         slots={"bastion": ("bastion.example.com", "jump.lab.example.net", "gw01"), "user": USERS,
                "host": HOSTS}),
    task("ssh.config_alias",
         goals=("create an SSH shortcut so that ssh {alias} connects to {user}@{host}",
                "add a Host entry named {alias} for {host} to my SSH config"),
         answers="Add an entry to ~/.ssh/config:\nHost {alias}\n    HostName {host}\n    User {user}\n"
                 "    IdentityFile ~/.ssh/{key}\n    IdentitiesOnly yes\n"
                 "The file must not be writable by others:\n$ chmod 600 ~/.ssh/config\n"
                 "Now this works:\n$ ssh {alias}",
         command="ssh {alias}",
         slots={"alias": ("gpu", "lab", "build", "trainer"), "user": USERS, "host": HOSTS, "key": _KEYS}),
    task("ssh.change_port",
         goals=("move sshd to port {port} on Fedora", "make the SSH server listen on port {port}"),
         answers="1. Set Port {port} in /etc/ssh/sshd_config.d/10-port.conf.\n"
                 "2. Allow the port in SELinux and the firewall:\n"
                 "$ sudo semanage port -a -t ssh_port_t -p tcp {port}\n"
                 "$ sudo firewall-cmd --permanent --add-port={port}/tcp\n$ sudo firewall-cmd --reload\n"
                 "3. Restart sshd and test from a second terminal before closing this one:\n"
                 "$ sudo systemctl restart sshd",
         command="semanage port -a -t ssh_port_t -p tcp {port}",
         slots={"port": ("2222", "2200", "22022")}),
    task("ssh.agent",
         goals=("stop typing the passphrase of my SSH key {key} for every connection",
                "load my SSH key {key} into the agent"),
         answers="$ eval \"$(ssh-agent -s)\"\n$ ssh-add ~/.ssh/{key}\nThe agent keeps the "
                 "decrypted key in memory for this session; ssh-add -l lists loaded keys. A "
                 "Fedora Workstation session usually runs an agent already, so ssh-add alone is enough.",
         command="ssh-add ~/.ssh/{key}",
         slots={"key": _KEYS}),
    task("ssh.debug_keys",
         questions=("SSH still asks for a password even though I copied my key to {user}@{host}. What should I check?",
                    ("ssh {user}@{host} fails with this error. What should I check?",
                     "{user}@{host}: Permission denied (publickey).")),
         answers="1. Run the client verbosely to see which keys it offers:\n$ ssh -v {user}@{host}\n"
                 "2. On the server, fix permissions; sshd ignores keys in writable locations:\n"
                 "$ chmod 700 ~/.ssh\n$ chmod 600 ~/.ssh/authorized_keys\n"
                 "3. Restore SELinux labels in case the files were copied in:\n$ restorecon -Rv ~/.ssh\n"
                 "4. Read the server log: sudo journalctl -u sshd -n 20.",
         command="ssh -v {user}@{host}",
         slots={"user": USERS, "host": HOSTS}),
    task("ssh.connection_refused",
         goals=("find out why SSH connections to {host} are refused",),
         questions=(("ssh to {host} fails immediately with this error. What should I check?",
                     "ssh: connect to host {host} port 22: Connection refused"),),
         answers="Connection refused means nothing accepts connections on port 22. On the server:\n"
                 "1. Make sure sshd runs and starts at boot:\n$ sudo systemctl enable --now sshd\n"
                 "2. Check that it listens and on which port:\n$ sudo ss -tlnp 'sport = :22'\n"
                 "3. Check that the firewall allows ssh:\n$ sudo firewall-cmd --list-services",
         command="systemctl enable --now sshd",
         slots={"host": HOSTS}),
    task("ssh.rsync",
         goals=("copy {src} to {dst} on {host} as {user} and resume if it is interrupted",
                "sync {src} to {user}@{host}:{dst} over SSH"),
         answers="$ rsync -avz --partial --progress {src} {user}@{host}:{dst}\n-a keeps "
                 "permissions and times, -z compresses, and --partial keeps partly sent files so "
                 "a rerun resumes. A trailing slash on the source copies its contents, not the "
                 "directory itself.",
         command="rsync -avz --partial --progress {src} {user}@{host}:{dst}",
         slots={"src": ("./dataset/", "~/models/", "results/", "./checkpoints/"), "user": USERS,
                "host": HOSTS, "dst": ("/srv/data/", "/srv/models/", "~/incoming/")}),
    task("ssh.host_key_changed",
         goals=("remove the old host key of {host} from known_hosts",),
         questions=(("ssh to {host} now fails with this warning. The server was reinstalled. What do I do?",
                     "WARNING: REMOTE HOST IDENTIFICATION HAS CHANGED!"),),
         answers="If you know the server was reinstalled and this is not an attack, remove the "
                 "stale entry:\n$ ssh-keygen -R {host}\nThen connect again and compare the new "
                 "fingerprint with the one the server reports. On the server run:\n"
                 "$ ssh-keygen -lf /etc/ssh/ssh_host_ed25519_key.pub",
         command="ssh-keygen -R {host}",
         slots={"host": HOSTS}),
]

TASKS = SELINUX + CGROUPS + SYSTEMD + JOURNALD + KERNEL_SYSCTL + USERS_PERMISSIONS + SSH
