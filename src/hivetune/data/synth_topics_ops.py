"""Synthetic-data tasks: networking, storage, monitoring, backups, performance, troubleshooting.

See :mod:`hivetune.data.synth_topics` for the template format and the answer convention.
"""

from __future__ import annotations

from hivetune.data.synth_topics import (ANY_SERVICES, DATA_DIRS, HOSTS, PIDS, SYSTEM_SERVICES,
                                        WEB_DIRS, task)

_PORTS = (
    {"port": "8080", "proto": "tcp", "what": "a web app"}, {"port": "8000", "proto": "tcp", "what": "vLLM"},
    {"port": "9090", "proto": "tcp", "what": "Prometheus"}, {"port": "3000", "proto": "tcp", "what": "Grafana"},
    {"port": "51820", "proto": "udp", "what": "WireGuard"}, {"port": "5353", "proto": "udp", "what": "mDNS"},
    {"port": "11434", "proto": "tcp", "what": "Ollama"}, {"port": "6443", "proto": "tcp", "what": "the Kubernetes API"},
    {"port": "8443", "proto": "tcp", "what": "an HTTPS admin UI"},
    {"port": "60000-60010", "proto": "udp", "what": "mosh"},
)
_TCP_PORTS = tuple(p for p in _PORTS if p["proto"] == "tcp")
_ZONES = ({"zopt": "", "zdesc": "the default zone"}, {"zopt": " --zone=internal", "zdesc": "the internal zone"},
          {"zopt": " --zone=public", "zdesc": "the public zone"})
_FIREWALLD_SERVICES = ("http", "https", "cockpit", "postgresql", "redis", "mdns", "nfs", "samba", "dns")
_NETWORKS = ("10.0.0.0/24", "192.168.1.0/24", "172.16.5.0/24", "10.20.0.0/16")
_CONNECTIONS = ("Wired connection 1", "enp3s0", "eno1", "office-lan")
_ADDRESSES = ({"ip": "192.168.1.50/24", "gw": "192.168.1.1"}, {"ip": "10.0.0.15/24", "gw": "10.0.0.1"},
              {"ip": "172.16.5.20/24", "gw": "172.16.5.1"})
_NAMES = ("gpu01.lab.example.com", "registry.example.com", "quay.io", "huggingface.co", "download.pytorch.org")

NETWORKING = [
    task("networking.open_port",
         goals=("open port {port}/{proto} for {what} in {zdesc} of firewalld",
                "allow incoming traffic on {port}/{proto} in {zdesc}",
                "let clients reach {what} on port {port}/{proto} through {zdesc} of the firewall"),
         questions=("I run {what} on port {port}/{proto}, but other machines can't connect. How do I open "
                    "it in {zdesc} of the firewall?",),
         answers=("Add the port to the permanent configuration, then reload so the running "
                  "firewall picks it up:\n$ sudo firewall-cmd --permanent{zopt} --add-port={port}/{proto}\n"
                  "$ sudo firewall-cmd --reload\nVerify:\n$ sudo firewall-cmd{zopt} --list-ports\n"
                  "Without --permanent the rule disappears at the next reload or reboot.",
                  "1. Add the rule permanently:\n$ sudo firewall-cmd --permanent{zopt} --add-port={port}/{proto}\n"
                  "2. Reload firewalld:\n$ sudo firewall-cmd --reload\n"
                  "3. Confirm that {port}/{proto} is listed:\n$ sudo firewall-cmd{zopt} --list-ports"),
         command="firewall-cmd --permanent{zopt} --add-port={port}/{proto}",
         slots={"p": _PORTS, "zone": _ZONES},
         brief="$ sudo firewall-cmd --permanent{zopt} --add-port={port}/{proto}\n"
               "Then sudo firewall-cmd --reload applies it; a rule without --permanent is lost at the next reload."),
    task("networking.no_route",
         goals=("fix No route to host errors when connecting to port {port} on my server",),
         questions=(("curl from another machine to {what} on my server fails like this. The service runs. Why?",
                     "curl: (7) Failed to connect to {host} port {port}: No route to host"),),
         answers="With the host reachable, \"No route to host\" usually is firewalld rejecting the "
                 "port. On the server check what is allowed:\n$ sudo firewall-cmd --list-all\n"
                 "then open the port and reload:\n$ sudo firewall-cmd --permanent --add-port={port}/tcp\n"
                 "$ sudo firewall-cmd --reload",
         command="firewall-cmd --permanent --add-port={port}/tcp",
         slots={"p": _TCP_PORTS, "host": HOSTS}),
    task("networking.add_service",
         goals=("allow the {service} service through firewalld", "open the predefined {service} service in the firewall"),
         answers="firewalld ships service definitions that bundle the right ports (see "
                 "firewall-cmd --get-services):\n$ sudo firewall-cmd --permanent --add-service={service}\n"
                 "$ sudo firewall-cmd --reload\n$ sudo firewall-cmd --list-services\n"
                 "Prefer services over raw ports: the rule stays readable.",
         command="firewall-cmd --permanent --add-service={service}",
         slots={"service": _FIREWALLD_SERVICES}),
    task("networking.rich_rule",
         goals=("allow port {port}/tcp only from {cidr} with firewalld",
                "restrict access to {what} on port {port} to the {cidr} network"),
         answers="Use a rich rule, which can match the source address:\n"
                 "$ sudo firewall-cmd --permanent --add-rich-rule='rule family=\"ipv4\" source "
                 "address=\"{cidr}\" port port=\"{port}\" protocol=\"tcp\" accept'\n"
                 "$ sudo firewall-cmd --reload\nMake sure the port is not also open to everyone "
                 "via --add-port. List the rules with firewall-cmd --list-rich-rules.",
         command="firewall-cmd --permanent --add-rich-rule='rule family=\"ipv4\" source address=\"{cidr}\" "
                 "port port=\"{port}\" protocol=\"tcp\" accept'",
         slots={"p": _TCP_PORTS, "cidr": _NETWORKS}),
    task("networking.forward_port",
         goals=("forward incoming port {src} to port {dst} on the same host with firewalld",
                "redirect traffic arriving on port {src} to a service on port {dst}"),
         answers="$ sudo firewall-cmd --permanent --add-forward-port=port={src}:proto=tcp:toport={dst}\n"
                 "$ sudo firewall-cmd --reload\nThis lets an unprivileged service listen on {dst} "
                 "while clients connect to {src}. Forwarding to another host also needs toaddr= "
                 "and masquerading.",
         command="firewall-cmd --permanent --add-forward-port=port={src}:proto=tcp:toport={dst}",
         slots={"fwd": ({"src": "80", "dst": "8080"}, {"src": "443", "dst": "8443"},
                        {"src": "80", "dst": "3000"})}),
    task("networking.listening",
         goals=("find which process is listening on port {port}", "check whether anything is already bound to port {port}"),
         answers="$ sudo ss -tlnp 'sport = :{port}'\n-t TCP, -l listening sockets, -n numeric "
                 "ports, -p the owning process (root is needed to see other users' processes). "
                 "Use -u instead of -t for UDP; lsof -i :{port} is an alternative.",
         command="ss -tlnp 'sport = :{port}'",
         slots={"port": ("8080", "8000", "5432", "6379", "9090", "3000", "443")}),
    task("networking.nft_list",
         goals=("show the complete nftables ruleset", "see the firewall rules that firewalld actually created"),
         answers="$ sudo nft list ruleset\nfirewalld uses nftables as its backend, so its rules "
                 "appear in the table inet firewalld. Don't edit that table by hand: firewalld "
                 "rewrites it on every reload. Put your own rules in a separate table.",
         command="nft list ruleset"),
    task("networking.nft_rule",
         goals=("add an nftables rule that accepts TCP port {port}", "open port {port} with plain nftables"),
         answers="Assuming you manage nftables yourself (firewalld disabled) with an inet filter "
                 "table and an input chain:\n$ sudo nft add rule inet filter input tcp dport {port} accept\n"
                 "Show the rules with their handles:\n$ sudo nft -a list chain inet filter input\n"
                 "To keep them, save the ruleset to /etc/sysconfig/nftables.conf and enable nftables.service.",
         command="nft add rule inet filter input tcp dport {port} accept",
         slots={"port": ("8080", "8000", "9100", "3000", "5432")}),
    task("networking.static_ip",
         goals=("give the connection {con} the static address {ip} with DNS server {dns}",
                "switch {con} from DHCP to the fixed IP {ip} and use {dns} for DNS"),
         answers="$ sudo nmcli con mod \"{con}\" ipv4.method manual ipv4.addresses {ip} "
                 "ipv4.gateway {gw} ipv4.dns {dns}\n$ sudo nmcli con up \"{con}\"\n"
                 "Check with ip -br addr. To go back to DHCP set ipv4.method auto and clear "
                 "ipv4.addresses and ipv4.gateway.",
         command="nmcli con mod \"{con}\" ipv4.method manual ipv4.addresses {ip} ipv4.gateway {gw} ipv4.dns {dns}",
         slots={"con": _CONNECTIONS, "addr": _ADDRESSES, "dns": ("1.1.1.1", "9.9.9.9", "8.8.8.8")}),
    task("networking.addr_route",
         goals=("show my IP addresses and the default route", "find out which interface is used to reach {dest}"),
         answers="$ ip -br addr\nlists every interface with its state and addresses.\n$ ip route\n"
                 "shows the routing table, and for one destination:\n$ ip route get {dest}\n"
                 "prints the interface, gateway and source address the kernel would use.",
         command="ip -br addr",
         slots={"dest": ("1.1.1.1", "10.0.0.15", "192.168.1.20")}),
    task("networking.dns",
         goals=("check which DNS server resolves {name}", "debug DNS resolution for {name}"),
         answers="Fedora uses systemd-resolved. Show the DNS servers per link:\n$ resolvectl status\n"
                 "Resolve the name the same way applications do:\n$ resolvectl query {name}\n"
                 "If that fails but dig @1.1.1.1 {name} works, the configured DNS server is the problem.",
         command="resolvectl query {name}",
         slots={"name": _NAMES}),
]

_VGS = ("fedora", "vg0", "data")
_LVS = ("root", "home", "var", "data")
_GROW = ({"sizeopt": "-L +20G", "grow": "by 20 GiB", "give": "20 GiB more"},
         {"sizeopt": "-L +50G", "grow": "by 50 GiB", "give": "50 GiB more"},
         {"sizeopt": "-l +100%FREE", "grow": "into all remaining free space", "give": "all remaining free space"})
_FILESYSTEMS = ("xfs", "ext4")
_MOUNTS = ("/srv/data", "/var/lib/containers", "/data", "/srv/models")
_BTRFS_MOUNTS = ("/", "/home", "/srv/data")
_DISKS = ("/dev/sdb", "/dev/nvme1n1", "/dev/vdb")

STORAGE = [
    task("storage.lvextend",
         goals=("grow the logical volume {vg}/{lv} {grow} and resize its filesystem",
                "give the logical volume {lv} in the volume group {vg} {give}"),
         answers="Check the free space first:\n$ sudo vgs {vg}\nThen extend the LV; -r resizes "
                 "the filesystem in the same step (XFS and ext4 can grow while mounted):\n"
                 "$ sudo lvextend -r {sizeopt} /dev/{vg}/{lv}\nConfirm with df -h and sudo lvs {vg}.",
         command="lvextend -r {sizeopt} /dev/{vg}/{lv}",
         slots={"vg": _VGS, "lv": _LVS, "grow": _GROW},
         brief="$ sudo lvextend -r {sizeopt} /dev/{vg}/{lv}\n"
               "-r resizes the filesystem in the same step (XFS and ext4 can grow while mounted)."),
    task("storage.lvcreate",
         goals=("create a {size} logical volume {lv} in {vg} and mount it at {mnt}",
                "add a new {fs} volume {lv} of {size} in {vg}, mounted on {mnt}"),
         answers="1. Create and format the volume:\n$ sudo lvcreate -L {size} -n {lv} {vg}\n"
                 "$ sudo mkfs.{fs} /dev/{vg}/{lv}\n2. Add this line to /etc/fstab:\n"
                 "/dev/{vg}/{lv} {mnt} {fs} defaults 0 0\n3. Create the mount point and mount it:\n"
                 "$ sudo mkdir -p {mnt}\n$ sudo systemctl daemon-reload\n$ sudo mount -a",
         command="lvcreate -L {size} -n {lv} {vg}",
         slots={"size": ("10G", "50G", "200G"), "lv": ("scratch", "models", "backup", "pgdata"),
                "vg": _VGS, "fs": _FILESYSTEMS, "mnt": _MOUNTS},
         brief="$ sudo lvcreate -L {size} -n {lv} {vg}\n"
               "Then put a filesystem on it with sudo mkfs.{fs} /dev/{vg}/{lv} and mount it on {mnt}."),
    task("storage.overview",
         goals=("list the disks, partitions and filesystems of this machine", "see how my disks are partitioned and mounted"),
         answers="$ lsblk -f\nshows the block-device tree with filesystem types, labels, UUIDs "
                 "and mount points. For LVM details add:\n$ sudo pvs\n$ sudo vgs\n$ sudo lvs\n"
                 "and df -h for the free space of each mounted filesystem.",
         command="lsblk -f"),
    task("storage.btrfs_snapshot",
         goals=("take a read-only btrfs snapshot of {src} called {tag}",
                "snapshot the btrfs subvolume {src} as {tag} before a risky change"),
         answers="Snapshots are instant and share data with the original until files change:\n"
                 "$ sudo mkdir -p {src}/.snapshots\n"
                 "$ sudo btrfs subvolume snapshot -r {src} {src}/.snapshots/{tag}\n"
                 "-r makes it read-only, which btrfs send requires. A snapshot is not a backup: "
                 "it lives on the same disk.",
         command="btrfs subvolume snapshot -r {src} {src}/.snapshots/{tag}",
         slots={"src": ("/home", "/srv/data", "/srv/models"), "tag": ("before-upgrade", "pre-migration", "2024-06-01")}),
    task("storage.btrfs_usage",
         goals=("see how much space is really free on the btrfs filesystem at {mnt}",
                "understand why df and btrfs disagree about free space on {mnt}"),
         answers="$ sudo btrfs filesystem usage {mnt}\ndf can mislead on btrfs because data and "
                 "metadata are allocated in chunks. If Unallocated is near zero while Data has "
                 "plenty free, compact the chunks with a filtered balance:\n"
                 "$ sudo btrfs balance start -dusage=50 {mnt}",
         command="btrfs filesystem usage {mnt}",
         slots={"mnt": _BTRFS_MOUNTS}),
    task("storage.btrfs_scrub",
         goals=("check the btrfs filesystem at {mnt} for corruption", "verify the checksums of all data on {mnt}"),
         answers="$ sudo btrfs scrub start {mnt}\n$ sudo btrfs scrub status {mnt}\nScrub reads "
                 "all data and metadata and verifies checksums; with a redundant profile such as "
                 "RAID1 it repairs bad copies. Per-device error counters: sudo btrfs device stats {mnt}.",
         command="btrfs scrub start {mnt}",
         slots={"mnt": _BTRFS_MOUNTS}),
    task("storage.btrfs_compress",
         goals=("enable zstd compression for {path} on btrfs", "compress the existing files in {path} on btrfs"),
         answers="Set the compression property so new files written there are compressed:\n"
                 "$ sudo btrfs property set {path} compression zstd\nCompress the existing files "
                 "by defragmenting them:\n$ sudo btrfs filesystem defragment -r -czstd {path}\n"
                 "For a whole filesystem use the mount option compress=zstd:1, Fedora's default.",
         command="btrfs property set {path} compression zstd",
         slots={"path": DATA_DIRS}),
    task("storage.du",
         goals=("find what uses the most disk space under {path}", "list the biggest directories in {path}"),
         answers="$ sudo du -xh --max-depth=1 {path} | sort -h\n-x stays on one filesystem, "
                 "--max-depth=1 sums up each subdirectory and sort -h orders human-readable sizes. "
                 "Then drill into the largest one. df -h {path} shows the overall usage.",
         command="du -xh --max-depth=1 {path} | sort -h",
         slots={"path": ("/", "/var", "/home", "/srv/models", "/var/lib/containers")}),
    task("storage.add_disk",
         goals=("add the new disk {disk} to the volume group {vg}", "extend the volume group {vg} with {disk}"),
         answers="Make sure the disk holds nothing you need (this destroys its contents), then:\n"
                 "$ sudo pvcreate {disk}\n$ sudo vgextend {vg} {disk}\n$ sudo vgs {vg}\n"
                 "The new space is free in {vg}; give it to a volume with lvextend -r.",
         command="vgextend {vg} {disk}",
         slots={"disk": _DISKS, "vg": _VGS}),
    task("storage.mount_fail",
         goals=("find out why {dev} refuses to mount on {mnt}",),
         questions=(("Mounting {dev} on {mnt} fails with this error. What should I check?",
                     "mount: {mnt}: wrong fs type, bad option, bad superblock on {dev}, missing "
                     "codepage or helper program, or other error."),),
         answers="1. Check what is actually on the device:\n$ sudo blkid {dev}\n"
                 "2. Read the kernel's reason:\n$ sudo dmesg -T | tail -n 20\n"
                 "3. If the type is right, the filesystem may be damaged. Check it unmounted "
                 "and without changes: sudo xfs_repair -n {dev} for XFS or sudo fsck -n {dev} for ext4.",
         command="blkid {dev}",
         slots={"dev": ("/dev/sdb1", "/dev/nvme1n1p1", "/dev/vdb1"), "mnt": _MOUNTS}),
    task("storage.smart",
         goals=("check the health of the disk {disk}", "read the SMART data of {disk}"),
         answers="With smartmontools installed:\n$ sudo smartctl -H {disk}\n$ sudo smartctl -a {disk}\n"
                 "-H gives a pass/fail verdict and -a all attributes: watch reallocated sectors "
                 "on SATA drives, Percentage Used and Media Errors on NVMe. For periodic checks "
                 "run sudo systemctl enable --now smartd.",
         command="smartctl -a {disk}",
         slots={"disk": ("/dev/sda", "/dev/nvme0n1", "/dev/sdb", "/dev/nvme1n1")}),
    task("storage.fstab",
         goals=("mount {dev} at {mnt} automatically at boot", "add {dev} to /etc/fstab by UUID"),
         answers="Device names can change between boots, so mount by UUID:\n$ sudo blkid {dev}\n"
                 "Add a line to /etc/fstab with that UUID:\nUUID=<uuid> {mnt} {fs} defaults,nofail 0 0\n"
                 "nofail keeps the boot going if the disk is missing. Then:\n$ sudo mkdir -p {mnt}\n"
                 "$ sudo systemctl daemon-reload\n$ sudo mount -a\n$ findmnt {mnt}",
         command="blkid {dev}",
         slots={"dev": ("/dev/sdb1", "/dev/nvme1n1p1", "/dev/vdb1"), "mnt": _MOUNTS, "fs": _FILESYSTEMS}),
]

_INTERVALS = ("1", "2", "5")

MONITORING = [
    task("monitoring.top_mem",
         goals=("list the {n} processes that use the most memory", "find the top {n} memory consumers"),
         answers="$ ps aux --sort=-%mem | head -n {n1}\nThe first line is the header, hence "
                 "{n1}. RSS is resident memory in KiB. For a live view sorted by memory run top "
                 "and press Shift+M.",
         command="ps aux --sort=-%mem | head -n {n1}",
         slots={"count": ({"n": "5", "n1": "6"}, {"n": "10", "n1": "11"}, {"n": "20", "n1": "21"})}),
    task("monitoring.top_cpu",
         goals=("list the {n} processes that use the most CPU", "find out which {n} processes keep the CPU busy"),
         answers="$ ps -eo pid,user,comm,%cpu,%mem --sort=-%cpu | head -n {n1}\nps averages CPU "
                 "over each process's lifetime. For current usage use top (press Shift+P) or "
                 "pidstat 1 from sysstat.",
         command="ps -eo pid,user,comm,%cpu,%mem --sort=-%cpu | head -n {n1}",
         slots={"count": ({"n": "5", "n1": "6"}, {"n": "10", "n1": "11"}, {"n": "20", "n1": "21"})}),
    task("monitoring.memory",
         goals=("see how much memory is free and whether the system is swapping",
                "check memory pressure every {interval} seconds"),
         answers="$ free -h\nLook at the available column, not free: Linux uses idle RAM as cache. "
                 "To watch swapping over time:\n$ vmstat {interval}\nNon-zero si/so columns mean "
                 "pages are being swapped in and out.",
         command="free -h",
         slots={"interval": _INTERVALS}),
    task("monitoring.iostat",
         goals=("find out whether my disks are the bottleneck, sampling every {interval} seconds",
                "measure disk utilization every {interval} seconds"),
         answers="With sysstat installed:\n$ iostat -xz {interval}\n%util near 100 with high "
                 "r_await or w_await means the device is saturated. To see which processes cause "
                 "the I/O:\n$ sudo iotop -o\n-o shows only processes that are doing I/O.",
         command="iostat -xz {interval}",
         slots={"interval": _INTERVALS}),
    task("monitoring.sar",
         goals=("take {count} samples of {what} every {interval} seconds with sar",
                "collect {count} sar samples of {what} at {interval} second intervals"),
         answers="$ sar {flag} {interval} {count}\nprints {count} samples {interval} seconds apart. "
                 "For history, enable the collector:\n$ sudo systemctl enable --now sysstat\n"
                 "then read today's data with sar {flag}, or an earlier day with "
                 "sar {flag} -f /var/log/sa/saDD.",
         command="sar {flag} {interval} {count}",
         slots={"metric": ({"flag": "-u", "what": "CPU usage"}, {"flag": "-r", "what": "memory usage"},
                           {"flag": "-n DEV", "what": "network throughput"},
                           {"flag": "-q", "what": "the load average"}),
                "interval": _INTERVALS, "count": ("5", "10", "30")}),
    task("monitoring.pidstat",
         goals=("monitor the CPU and memory of process {pid} every {interval} seconds",
                "watch the resource usage of PID {pid} at {interval} second intervals"),
         answers="$ pidstat -u -r -p {pid} {interval}\n-u reports CPU, -r page faults and "
                 "resident memory; add -d for disk I/O. pidstat is part of the sysstat package.",
         command="pidstat -u -r -p {pid} {interval}",
         slots={"pid": PIDS, "interval": _INTERVALS}),
    task("monitoring.node_exporter",
         goals=("run the Prometheus node exporter in a podman container", "export host metrics for Prometheus"),
         answers="$ sudo podman run -d --name node-exporter --net host --pid host -v /:/host:ro,rslave "
                 "quay.io/prometheus/node-exporter:latest --path.rootfs=/host\nIt listens on port "
                 "9100. Test it:\n$ curl -s localhost:9100/metrics | head\n"
                 "Open 9100/tcp only to your Prometheus server.",
         command="podman run -d --name node-exporter --net host --pid host -v /:/host:ro,rslave "
                 "quay.io/prometheus/node-exporter:latest --path.rootfs=/host"),
    task("monitoring.cockpit",
         goals=("get a web dashboard for my Fedora server", "manage this server from a browser with Cockpit"),
         answers="Cockpit is packaged in Fedora:\n$ sudo dnf install cockpit\n"
                 "$ sudo systemctl enable --now cockpit.socket\n"
                 "$ sudo firewall-cmd --permanent --add-service=cockpit\n$ sudo firewall-cmd --reload\n"
                 "Then browse to https://SERVER:9090 and log in with a local account.",
         command="systemctl enable --now cockpit.socket"),
    task("monitoring.load",
         goals=("understand the load average numbers that uptime prints", "tell whether my server is overloaded"),
         answers="$ uptime\nThe three numbers are the 1, 5 and 15 minute load averages: runnable "
                 "plus uninterruptible (D state) tasks. Compare them with the CPU count from nproc; "
                 "a load steadily above it means work is queueing. High load with idle CPUs "
                 "usually means processes blocked on disk or NFS.",
         command="uptime"),
    task("monitoring.gpu_watch",
         goals=("keep an eye on {vendor} GPU usage while a training job runs", "watch my {vendor} GPU live from a terminal"),
         answers="nvtop (sudo dnf install nvtop) is a live, htop-like view for NVIDIA, AMD and "
                 "Intel GPUs:\n$ nvtop\nFor a simple refresh of the vendor tool every second:\n"
                 "$ watch -n 1 {tool}",
         command="watch -n 1 {tool}",
         slots={"gpu": ({"vendor": "NVIDIA", "tool": "nvidia-smi"}, {"vendor": "AMD", "tool": "rocm-smi"})}),
]

_RESTIC_REPOS = ("/mnt/backup/restic", "sftp:backup@nas:/restic", "s3:https://s3.example.com/backups")
_BACKUP_SOURCES = ("/home/alice", "/srv/www", "/etc", "/srv/models", "/var/lib/app")
_ARCHIVE_FORMATS = ({"flag": "-czf", "ext": "tar.gz", "alg": "gzip"},
                    {"flag": "--zstd -cf", "ext": "tar.zst", "alg": "zstd"},
                    {"flag": "-cJf", "ext": "tar.xz", "alg": "xz"})

BACKUPS = [
    task("backups.rsync_mirror",
         goals=("mirror {src} to {dst} with rsync, keeping permissions and ACLs",
                "make an exact copy of {src} on {dst} including SELinux labels"),
         answers="$ sudo rsync -aAXH --delete {src}/ {dst}{src}/\n-a keeps permissions, times and "
                 "symlinks, -A ACLs, -X extended attributes (including SELinux labels) and -H hard "
                 "links. --delete removes files that vanished from the source, so try it with "
                 "--dry-run first.",
         command="rsync -aAXH --delete {src}/ {dst}{src}/",
         slots={"src": _BACKUP_SOURCES, "dst": ("/mnt/backup", "/run/media/alice/usb-backup", "backup01:/backups")}),
    task("backups.tar",
         goals=("create a {alg}-compressed archive of {path} with today's date in the name",
                "pack {path} into a dated {ext} file"),
         answers="$ tar {flag} {name}-$(date +%F).{ext} {path}\n$(date +%F) expands to YYYY-MM-DD. "
                 "List the contents without extracting:\n$ tar -tf {name}-$(date +%F).{ext}\n"
                 "Extract later with tar -xf, which detects the compression itself.",
         command="tar {flag} {name}-$(date +%F).{ext} {path}",
         slots={"fmt": _ARCHIVE_FORMATS, "src": ({"path": "/etc", "name": "etc"},
                                                 {"path": "/srv/www", "name": "www"},
                                                 {"path": "/home/alice", "name": "alice-home"},
                                                 {"path": "/var/lib/app", "name": "app-data"})}),
    task("backups.restic",
         goals=("back up {path} with restic to {repo}", "start using restic for backups of {path} to {repo}"),
         answers="1. Initialize the repository once (it asks for a password):\n$ restic -r {repo} init\n"
                 "2. Run a backup:\n$ restic -r {repo} backup {path}\n3. List the snapshots:\n"
                 "$ restic -r {repo} snapshots\nBackups are deduplicated and encrypted; without "
                 "the password the data cannot be recovered.",
         command="restic -r {repo} backup {path}",
         slots={"repo": _RESTIC_REPOS, "path": _BACKUP_SOURCES}),
    task("backups.restic_restore",
         goals=("restore {path} from the latest snapshot in {repo} into {target}",
                "get {path} back from my restic repository {repo}, restoring into {target}"),
         answers="$ restic -r {repo} restore latest --target {target} --include {path}\nThe "
                 "files appear under {target} with their full original path, so you can compare "
                 "before copying them back. Use a snapshot ID from restic snapshots instead of "
                 "latest for an older state.",
         command="restic -r {repo} restore latest --target {target} --include {path}",
         slots={"repo": _RESTIC_REPOS, "path": _BACKUP_SOURCES, "target": ("/tmp/restore", "/srv/restore")}),
    task("backups.restic_forget",
         goals=("keep only {daily} daily and {weekly} weekly snapshots in the restic repository {repo}",
                "prune the restic repository {repo} to {daily} daily and {weekly} weekly snapshots"),
         answers="$ restic -r {repo} forget --keep-daily {daily} --keep-weekly {weekly} --prune\n"
                 "forget drops snapshots that fall outside the policy and --prune deletes the "
                 "data nothing references any more. Run restic -r {repo} check now and then to "
                 "verify the repository.",
         command="restic -r {repo} forget --keep-daily {daily} --keep-weekly {weekly} --prune",
         slots={"repo": _RESTIC_REPOS, "daily": ("7", "14"), "weekly": ("4", "8")}),
    task("backups.borg",
         goals=("back up {path} with borg into a new dated archive in {repo}",
                "start backing up {path} to {repo} with BorgBackup"),
         answers="$ borg init --encryption=repokey {repo}\n"
                 "$ borg create --stats {repo}::{name}-$(date +%F) {path}\n$ borg list {repo}\n"
                 "init is needed only once. Thin out old archives with borg prune --keep-daily=7 "
                 "--keep-weekly=4 {repo}, then borg compact {repo} to free the space.",
         command="borg create --stats {repo}::{name}-$(date +%F) {path}",
         slots={"repo": ("/mnt/backup/borg", "ssh://backup@nas/./borg"),
                "src": ({"path": "/home/alice", "name": "home"}, {"path": "/etc", "name": "etc"},
                        {"path": "/srv/www", "name": "www"})}),
    task("backups.pg_dump",
         goals=("back up the PostgreSQL database {db} so I can restore it later",
                "dump the {db} database in PostgreSQL's custom format"),
         answers="Dump in the custom format, which is compressed and allows selective restores:\n"
                 "$ pg_dump -Fc -f {db}.dump {db}\nRestore into an existing empty database:\n"
                 "$ pg_restore -d {db} {db}.dump\nRun both as a role with access to the "
                 "database, for example with sudo -u postgres.",
         command="pg_dump -Fc -f {db}.dump {db}",
         slots={"db": ("appdb", "inventory", "mlflow", "analytics")}),
    task("backups.podman_volume",
         goals=("back up the podman volume {vol} to a tar file", "move the podman volume {vol} to another machine"),
         answers="$ podman volume export {vol} --output {vol}.tar\nStop containers that write to "
                 "the volume first for a consistent copy. Restore it into a new volume with:\n"
                 "$ podman volume create {vol}\n$ podman volume import {vol} {vol}.tar",
         command="podman volume export {vol} --output {vol}.tar",
         slots={"vol": ("pgdata", "redis-data", "grafana-storage", "models-cache")}),
    task("backups.btrfs_send",
         goals=("copy a btrfs snapshot of /home tagged {tag} to the external btrfs disk at {dst}",
                "send a read-only snapshot home-{tag} of /home to the btrfs disk mounted at {dst}"),
         answers="btrfs send only works on read-only snapshots:\n"
                 "$ sudo btrfs subvolume snapshot -r /home /home/.snapshots/home-{tag}\n"
                 "$ sudo btrfs send /home/.snapshots/home-{tag} | sudo btrfs receive {dst}\n"
                 "Later send only the changes with -p and the previous snapshot as parent.",
         command="btrfs send /home/.snapshots/home-{tag} | sudo btrfs receive {dst}",
         slots={"tag": ("2024-06-01", "weekly", "before-upgrade"), "dst": ("/mnt/external", "/run/media/alice/backup")}),
    task("backups.lvm_snapshot",
         goals=("take a {size} LVM snapshot of {vg}/{lv} before an upgrade",
                "create a {size} LVM snapshot of {lv} in {vg} that I can roll back to"),
         answers="$ sudo lvcreate -s -L {size} -n {lv}-snap /dev/{vg}/{lv}\nThe snapshot only "
                 "needs room for blocks that change while it exists; if it fills up it becomes "
                 "invalid, so watch Data% in lvs. Roll back with sudo lvconvert --merge "
                 "/dev/{vg}/{lv}-snap or drop it with lvremove.",
         command="lvcreate -s -L {size} -n {lv}-snap /dev/{vg}/{lv}",
         slots={"vg": _VGS, "lv": _LVS, "size": ("5G", "10G", "20G")}),
]

_TUNED_PROFILES = (
    {"profile": "throughput-performance", "use": "a compute or batch server"},
    {"profile": "latency-performance", "use": "a latency-sensitive service"},
    {"profile": "powersave", "use": "a laptop on battery"},
    {"profile": "virtual-guest", "use": "a virtual machine"},
    {"profile": "balanced", "use": "a general-purpose desktop"},
    {"profile": "network-throughput", "use": "a host that moves a lot of network traffic"},
    {"profile": "accelerator-performance", "use": "a GPU or accelerator host"},
)
_WORKLOADS = ("python train.py", "./server", "make -j16", "python benchmark.py")
_FIO_MODES = ({"rw": "randread", "bs": "4k", "rwdesc": "random read"},
              {"rw": "randwrite", "bs": "4k", "rwdesc": "random write"},
              {"rw": "read", "bs": "1M", "rwdesc": "sequential read"},
              {"rw": "write", "bs": "1M", "rwdesc": "sequential write"})

PERFORMANCE = [
    task("performance.tuned",
         goals=("switch tuned to the {profile} profile", "tune my machine for {use} with tuned"),
         answers="$ sudo tuned-adm profile {profile}\n$ tuned-adm active\ntuned applies sysctl, "
                 "CPU governor and disk settings suited to {use}, and the choice persists across "
                 "reboots. tuned-adm list shows all profiles; tuned-adm recommend suggests one.",
         command="tuned-adm profile {profile}",
         slots={"tp": _TUNED_PROFILES},
         brief="$ sudo tuned-adm profile {profile}\n"
               "tuned applies sysctl, CPU governor and disk settings suited to {use}, and the choice persists "
               "across reboots."),
    task("performance.governor",
         goals=("check and change the CPU frequency governor to {gov}", "set the CPU governor to {gov} for a benchmark"),
         answers="Install kernel-tools for cpupower, then:\n$ cpupower frequency-info\n"
                 "$ sudo cpupower frequency-set -g {gov}\nThe setting is lost at reboot; a tuned "
                 "profile is the persistent way. With the amd-pstate or intel_pstate drivers "
                 "often only performance and powersave exist.",
         command="cpupower frequency-set -g {gov}",
         slots={"gov": ("performance", "powersave", "schedutil")},
         brief="$ sudo cpupower frequency-set -g {gov}\n"
               "The setting is lost at reboot; a tuned profile is the persistent way."),
    task("performance.perf_record",
         goals=("profile which functions process {pid} spends its CPU time in over {secs} seconds",
                "record a CPU profile with call graphs of PID {pid} for {secs} seconds"),
         answers="$ sudo perf record -g -p {pid} -- sleep {secs}\nrecords call stacks for {secs} "
                 "seconds into perf.data. Then:\n$ sudo perf report\nFor a live system-wide view "
                 "use sudo perf top. Install the perf package first; debuginfo gives better symbols.",
         command="perf record -g -p {pid} -- sleep {secs}",
         slots={"pid": PIDS, "secs": ("10", "30", "60")}),
    task("performance.numa",
         goals=("run {cmd} on NUMA node {node} only", "keep {cmd} and its memory on NUMA node {node}"),
         answers="Show the topology first:\n$ numactl --hardware\nThen bind CPUs and memory to "
                 "one node so the process avoids slow remote memory:\n"
                 "$ numactl --cpunodebind={node} --membind={node} {cmd}\n"
                 "numastat shows per-node memory use while it runs.",
         command="numactl --cpunodebind={node} --membind={node} {cmd}",
         slots={"cmd": _WORKLOADS, "node": ("0", "1")}),
    task("performance.taskset",
         goals=("pin {cmd} to CPU cores {cores}", "start {cmd} so that it only runs on CPUs {cores}"),
         answers="$ taskset -c {cores} {cmd}\nFor a process that is already running:\n"
                 "$ taskset -cp {cores} {pid}\nPinning makes benchmarks repeatable; for services "
                 "set CPUAffinity={cores} in the unit instead.",
         command="taskset -c {cores} {cmd}",
         slots={"cores": ("0-3", "0-7", "4-7", "2,3"), "cmd": _WORKLOADS, "pid": PIDS}),
    task("performance.threads",
         goals=("limit the number of CPU threads my training script uses to {n}",
                "stop PyTorch on the CPU from starting more than {n} threads"),
         answers="$ OMP_NUM_THREADS={n} MKL_NUM_THREADS={n} python train.py\nPyTorch and NumPy "
                 "size their thread pools from these variables at start-up; inside the script "
                 "torch.set_num_threads({n}) does the same. Use the number of physical cores: "
                 "oversubscription makes training slower.",
         command="OMP_NUM_THREADS={n} MKL_NUM_THREADS={n} python train.py",
         slots={"n": ("2", "4", "8", "16")}),
    task("performance.nice",
         goals=("run {cmd} at nice level {prio} with idle I/O priority", "make {cmd} yield to interactive work with nice {prio}"),
         answers="$ nice -n {prio} ionice -c 3 {cmd}\nnice -n {prio} lowers the CPU priority (19 "
                 "is the lowest) and ionice -c 3 puts disk I/O in the idle class. For a process "
                 "that is already running:\n$ renice -n {prio} -p {pid}",
         command="nice -n {prio} ionice -c 3 {cmd}",
         slots={"cmd": _WORKLOADS, "prio": ("10", "15", "19"), "pid": PIDS}),
    task("performance.swap",
         goals=("check swap and zram usage on Fedora", "see whether zram swap is active and how full it is"),
         answers="$ swapon --show\n$ zramctl\nFedora uses zram swap by default: compressed swap in "
                 "RAM set up by zram-generator. Change its size with zram-size in "
                 "/etc/systemd/zram-generator.conf and reboot.",
         command="zramctl"),
    task("performance.nofile",
         goals=("raise the open file limit of {svc} to {n}", "increase LimitNOFILE for the {svc} service"),
         answers="For a systemd service set it in a drop-in:\n$ sudo systemctl edit {svc}\n"
                 "[Service]\nLimitNOFILE={n}\n$ sudo systemctl restart {svc}\nCheck the running "
                 "process in /proc/PID/limits. ulimit -n only affects the current shell and its children.",
         command="systemctl edit {svc}",
         slots={"svc": ANY_SERVICES, "n": ("65535", "1048576")}),
    task("performance.fio",
         goals=("benchmark the {rwdesc} performance of {dir} with fio", "measure {rwdesc} IOPS of the disk behind {dir}"),
         answers="$ fio --name=test --directory={dir} --rw={rw} --bs={bs} --size=1G --numjobs=4 "
                 "--iodepth=32 --ioengine=libaio --direct=1 --group_reporting\n--direct=1 bypasses "
                 "the page cache, so you measure the disk and not RAM. Look at IOPS and the clat "
                 "percentiles, and delete the test files afterwards.",
         command="fio --name=test --directory={dir} --rw={rw} --bs={bs} --size=1G --numjobs=4 "
                 "--iodepth=32 --ioengine=libaio --direct=1 --group_reporting",
         slots={"mode": _FIO_MODES, "dir": ("/srv/data", "/var/tmp", "/mnt/nvme")}),
    task("performance.strace",
         goals=("count which system calls process {pid} makes", "see where PID {pid} spends time in the kernel"),
         answers="$ sudo strace -c -f -p {pid}\nLet it run while the problem happens, then press "
                 "Ctrl+C for a table of calls, errors and time per syscall. -f includes threads "
                 "and children. strace slows the process down a lot, so keep it short in production.",
         command="strace -c -f -p {pid}",
         slots={"pid": PIDS}),
]

_SPACE_ERRORS = ("write error: No space left on device", "OSError: [Errno 28] No space left on device",
                 "Error: writing blob: storing blob to file: no space left on device")
_JOBS = ("training script", "Python process", "vLLM server", "compile job")

TROUBLESHOOTING = [
    task("troubleshooting.service_failed",
         goals=("debug why the {svc} service fails to start",),
         questions=(("{svc} won't start. systemctl prints this:",
                     "Job for {svc}.service failed because the control process exited with error code."),
                    "My {svc} service keeps failing at boot. Where do I look first?"),
         answers="1. See its state and the last log lines:\n$ systemctl status {svc}\n"
                 "2. Read the full log of this boot:\n$ journalctl -u {svc} -b --no-pager -n 100\n"
                 "3. Fix the cause (often a config error, a missing file, a port in use or an "
                 "SELinux denial) and start it again:\n$ sudo systemctl restart {svc}\n"
                 "Many daemons have a config test, such as nginx -t or sshd -t.",
         command="journalctl -u {svc} -b --no-pager -n 100",
         slots={"svc": ANY_SERVICES},
         brief="$ journalctl -u {svc} -b --no-pager -n 100\n"
               "The last log lines of this boot usually name the cause: a config error, a missing file, a port "
               "in use or an SELinux denial."),
    task("troubleshooting.disk_full",
         goals=("free disk space on a full root filesystem",),
         questions=(("My {job} fails with this error. What should I check?", "{err}"),
                    "df says / is 100% full. How do I find out what filled it?"),
         answers="1. Find the full filesystem and the biggest directories:\n$ df -h\n"
                 "$ sudo du -xh --max-depth=1 / | sort -h\n2. Common quick wins:\n"
                 "$ sudo journalctl --vacuum-size=500M\n$ podman system prune\n$ sudo dnf clean all\n"
                 "3. If df shows space used that du cannot find, a deleted file is still held "
                 "open; find it with sudo lsof +L1.",
         command="df -h",
         slots={"job": _JOBS + ("podman build", "dnf upgrade"), "err": _SPACE_ERRORS}),
    task("troubleshooting.port_in_use",
         goals=("find out what is already using port {port}",),
         questions=(("{svc} fails to start with this error:", "bind: address already in use (port {port})"),
                    ("My server on port {port} crashes on start-up with this traceback line. What now?",
                     "OSError: [Errno 98] Address already in use")),
         answers="Another process already listens on port {port}. Find it:\n"
                 "$ sudo ss -tlnp 'sport = :{port}'\nStop that process or service, or move "
                 "{svc} to another port. If it is an old instance of the same program, "
                 "pgrep -a {svc} shows it.",
         command="ss -tlnp 'sport = :{port}'",
         slots={"port": ("8080", "8000", "5432", "6379", "3000"), "svc": ANY_SERVICES}),
    task("troubleshooting.oom",
         goals=("tell whether the OOM killer stopped my {job}",),
         questions=(("My {job} died and the terminal only printed this. What happened?", "Killed"),
                    "My {job} disappears without a traceback after a while. How do I check for out-of-memory kills?"),
         answers="\"Killed\" without a traceback usually means the kernel OOM killer (or "
                 "systemd-oomd) ended the process. Confirm it:\n"
                 "$ journalctl -k -b -g \"out of memory\"\n$ journalctl -u systemd-oomd -b\n"
                 "Then reduce memory use (smaller batches, fewer workers) or add RAM or swap; "
                 "free -h shows what is available.",
         command="journalctl -k -b -g \"out of memory\"",
         slots={"job": _JOBS}),
    task("troubleshooting.dns",
         goals=("find out why this machine cannot resolve {name}",),
         questions=(("curl fails with this error. How do I debug it?", "curl: (6) Could not resolve host: {name}"),
                    "Name resolution for {name} stopped working on my Fedora box. What should I check?"),
         answers="1. See which DNS servers are in use:\n$ resolvectl status\n"
                 "2. Resolve the name through systemd-resolved:\n$ resolvectl query {name}\n"
                 "3. Separate DNS from connectivity:\n$ ping -c 3 1.1.1.1\n"
                 "If the ping works but the query fails, fix the DNS servers of the connection "
                 "with nmcli con mod ... ipv4.dns.",
         command="resolvectl query {name}",
         slots={"name": _NAMES}),
    task("troubleshooting.gpu_missing",
         goals=("find out why my NVIDIA GPU is not detected after a kernel update",),
         questions=(("nvidia-smi prints this after an update. What should I check?",
                     "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. "
                     "Make sure that the latest NVIDIA driver is installed and running."),
                    "My NVIDIA card disappeared after I updated Fedora. How do I debug the driver?"),
         answers="1. Check the card is on the PCI bus and which driver is bound:\n"
                 "$ lspci -k | grep -EA3 'VGA|3D'\n2. Check the module was built for the "
                 "running kernel:\n$ modinfo -F version nvidia\nWith RPM Fusion's akmod-nvidia, "
                 "rebuild it and reboot:\n$ sudo akmods --force\n3. With Secure Boot on, an "
                 "unsigned module won't load:\n$ mokutil --sb-state",
         command="lspci -k | grep -EA3 'VGA|3D'"),
    task("troubleshooting.container_exits",
         goals=("find out why the podman container {name} exits right after it starts",),
         questions=("My podman container {name} stops immediately after podman run. How do I see why?",),
         answers="$ podman ps -a --filter name={name}\n$ podman logs {name}\n"
                 "$ podman inspect {name} --format '{{.State.ExitCode}} {{.State.Error}}'\n"
                 "Exit code 125 means podman itself failed, 126 and 127 that the command could "
                 "not run or was not found; anything else comes from the application. Start a "
                 "shell in the image to look around: podman run -it --entrypoint sh IMAGE.",
         command="podman logs {name}",
         slots={"name": ("web", "api", "llama", "worker", "db")}),
    task("troubleshooting.selinux_denied",
         goals=("find out why {svc} gets permission denied on {path} despite correct modes",),
         questions=("I get permission denied on {path} even though chmod 777 didn't help. What now?",),
         answers="When classic permissions look right, suspect SELinux:\n$ ls -Zd {path}\n"
                 "$ sudo ausearch -m AVC -ts recent\nIf there are denials, fix the label with "
                 "semanage fcontext plus restorecon -Rv {path}, or set the right boolean. "
                 "Never use chmod 777 as a fix: it doesn't help with SELinux and opens the files to everyone.",
         command="ausearch -m AVC -ts recent",
         slots={"svc": SYSTEM_SERVICES, "path": WEB_DIRS + DATA_DIRS}),
    task("troubleshooting.network_down",
         goals=("get the network back when ping says the network is unreachable",),
         questions=(("ping fails with this message. What should I check?", "ping: connect: Network is unreachable"),),
         answers="The kernel has no route for the destination, usually because the interface "
                 "has no address. Check step by step:\n$ nmcli device status\n$ ip -br addr\n"
                 "$ ip route\nIf the connection is down, bring it up with "
                 "sudo nmcli con up \"{con}\" and read journalctl -u NetworkManager -b for errors.",
         command="nmcli device status",
         slots={"con": _CONNECTIONS}),
    task("troubleshooting.d_state",
         goals=("explain a high load average while the CPUs are mostly idle",),
         questions=("Load average is {load} but top shows the CPUs almost idle. What is going on?",),
         answers="Load counts tasks in uninterruptible sleep (D state), usually waiting for "
                 "disk or NFS. List them:\n$ ps -eo pid,stat,wchan:32,comm | awk '$2 ~ /^D/'\n"
                 "The wchan column hints at where they wait. Then check the storage with "
                 "iostat -xz 1 and the kernel log with journalctl -k -b.",
         command="ps -eo pid,stat,wchan:32,comm | awk '$2 ~ /^D/'",
         slots={"load": ("12", "30", "45")}),
    task("troubleshooting.open_files",
         goals=("fix a Too many open files error in {svc}, which runs as PID {pid}",),
         questions=(("{svc} (PID {pid}) logs this error under load. How do I fix it?", "accept4(): Too many open files"),),
         answers="The process hit its file descriptor limit. Count what it has open:\n"
                 "$ ls /proc/{pid}/fd | wc -l\nand compare with the Max open files line in "
                 "/proc/{pid}/limits. Raise LimitNOFILE for the service with sudo systemctl edit "
                 "{svc}, then restart it. Check also for a descriptor leak.",
         command="ls /proc/{pid}/fd | wc -l",
         slots={"svc": ANY_SERVICES, "pid": PIDS}),
]

TASKS = NETWORKING + STORAGE + MONITORING + BACKUPS + PERFORMANCE + TROUBLESHOOTING
