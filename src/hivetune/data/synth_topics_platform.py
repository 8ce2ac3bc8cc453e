"""Synthetic-data tasks: rpm-ostree, bootc, dnf, GPU containers, ROCm and CUDA tools.

See :mod:`hivetune.data.synth_topics` for the template format and the answer convention.
"""

from __future__ import annotations

from hivetune.data.synth_topics import CLI_PACKAGES, CUDA_IMAGES, GPU_IDS, ROCM_IMAGES, task

_BASE_PACKAGES = ({"bpkg": "firefox firefox-langpacks", "first": "firefox", "what": "the Firefox RPM"},
                  {"bpkg": "gnome-tour", "first": "gnome-tour", "what": "GNOME Tour"},
                  {"bpkg": "gnome-software-rpm-ostree", "first": "gnome-software-rpm-ostree",
                   "what": "the rpm-ostree plugin of GNOME Software"})
_OSTREE_KARGS = ("rd.driver.blacklist=nouveau", "modprobe.blacklist=nouveau", "nvidia-drm.modeset=1",
                 "iommu=pt", "amdgpu.ppfeaturemask=0xffffffff")
_VARIANTS = ({"variant": "silverblue", "desktop": "Silverblue"}, {"variant": "kinoite", "desktop": "Kinoite"})
_ATOMIC = ("Fedora Silverblue", "Fedora Kinoite", "my Fedora Atomic desktop")

OSTREE = [
    task("ostree.status",
         goals=("see which deployment is booted on {atomic}", "list my rpm-ostree deployments and layered packages"),
         answers="$ rpm-ostree status\nThe deployment marked with ● is the booted one; the other "
                 "is the rollback target or a staged update. LayeredPackages lists what you "
                 "installed on top of the base image. Add -v for more detail.",
         command="rpm-ostree status",
         slots={"atomic": _ATOMIC}),
    task("ostree.install",
         goals=("install {pkg} on {atomic}", "layer the {pkg} package onto my Fedora Atomic system"),
         answers="Layer it onto the OS image; it becomes part of the next deployment:\n"
                 "$ sudo rpm-ostree install {pkg}\n$ systemctl reboot\nFor tools only you use, "
                 "a toolbox container avoids layering and keeps updates fast.",
         command="rpm-ostree install {pkg}",
         slots={"pkg": CLI_PACKAGES, "atomic": _ATOMIC}),
    task("ostree.apply_live",
         goals=("install {pkg} on {atomic} without rebooting", "use a newly layered package like {pkg} right away"),
         answers="$ sudo rpm-ostree install --apply-live {pkg}\n--apply-live layers the package "
                 "into a new deployment and also applies it to the running system, so {pkg} works "
                 "immediately. The change stays after the next reboot as well.",
         command="rpm-ostree install --apply-live {pkg}",
         slots={"pkg": CLI_PACKAGES, "atomic": _ATOMIC}),
    task("ostree.rollback",
         goals=("roll back to the previous deployment after a bad update on {atomic}",
                "undo the last rpm-ostree upgrade"),
         questions=("After today's update my {atomic} has a broken graphics stack. How do I go back?",),
         answers="$ sudo rpm-ostree rollback\n$ systemctl reboot\nrollback makes the previous "
                 "deployment the default for the next boot. Nothing is deleted, so you can roll "
                 "forward the same way. If the system does not boot at all, pick the older entry "
                 "in the GRUB menu instead.",
         command="rpm-ostree rollback",
         slots={"atomic": _ATOMIC}),
    task("ostree.upgrade",
         goals=("check for and apply OS updates on {atomic}", "update the base image of my Fedora Atomic system"),
         answers="$ rpm-ostree upgrade --check\nshows whether a new version is available. Download "
                 "and stage it:\n$ sudo rpm-ostree upgrade\nIt takes effect at the next boot "
                 "(systemctl reboot); the running system is untouched until then.",
         command="rpm-ostree upgrade",
         slots={"atomic": _ATOMIC}),
    task("ostree.uninstall",
         goals=("remove the layered package {pkg} from {atomic}", "stop layering {pkg} on my Fedora Atomic system"),
         answers="$ sudo rpm-ostree uninstall {pkg}\nThis only works for layered packages; hide "
                 "base-image packages with rpm-ostree override remove instead. sudo rpm-ostree "
                 "reset drops all layering at once. Reboot to apply.",
         command="rpm-ostree uninstall {pkg}",
         slots={"pkg": CLI_PACKAGES, "atomic": _ATOMIC}),
    task("ostree.override_remove",
         goals=("remove {what} from the base image of {atomic}", "hide the base package {first} on my Fedora Atomic system"),
         answers="$ sudo rpm-ostree override remove {bpkg}\nThis hides base-image packages in new "
                 "deployments; reboot to apply. Undo it with sudo rpm-ostree override reset "
                 "{first}. rpm-ostree status lists active overrides.",
         command="rpm-ostree override remove {bpkg}",
         slots={"base": _BASE_PACKAGES, "atomic": _ATOMIC}),
    task("ostree.kargs",
         goals=("add the kernel argument {karg} on {atomic}", "set {karg} on the kernel command line with rpm-ostree"),
         answers="$ sudo rpm-ostree kargs --append={karg}\nThis creates a new deployment with the "
                 "argument; reboot to use it. rpm-ostree kargs without options prints the current "
                 "arguments, and --delete={karg} removes it again.",
         command="rpm-ostree kargs --append={karg}",
         slots={"karg": _OSTREE_KARGS, "atomic": _ATOMIC}),
    task("ostree.rebase",
         goals=("upgrade my {desktop} installation to Fedora {ver}", "rebase {desktop} to the Fedora {ver} branch"),
         answers="Major upgrades are a rebase to the new branch:\n"
                 "$ sudo rpm-ostree rebase fedora:fedora/{ver}/x86_64/{variant}\n$ systemctl reboot\n"
                 "The old deployment stays available as a rollback. Check rpm-ostree status before "
                 "rebooting.",
         command="rpm-ostree rebase fedora:fedora/{ver}/x86_64/{variant}",
         slots={"v": _VARIANTS, "ver": ("41", "42")}),
    task("ostree.pin",
         goals=("keep deployment {idx} from being garbage collected", "pin deployment {idx} on {atomic}"),
         answers="$ sudo ostree admin pin {idx}\nThe index is the position in rpm-ostree status, "
                 "starting at 0. Pinned deployments are kept however many updates follow. "
                 "Unpin with sudo ostree admin pin --unpin {idx}.",
         command="ostree admin pin {idx}",
         slots={"idx": ("0", "1"), "atomic": _ATOMIC}),
    task("ostree.diff",
         goals=("see which packages changed in the last update on {atomic}", "compare the packages of two rpm-ostree deployments"),
         answers="$ rpm-ostree db diff\nWithout arguments it compares the booted deployment with "
                 "the pending one an upgrade staged, listing upgraded, downgraded, added and removed "
                 "packages. After rebooting into the update, pass the previous deployment's commit "
                 "from rpm-ostree status to compare it with the booted one.",
         command="rpm-ostree db diff",
         slots={"atomic": _ATOMIC}),
    task("ostree.cleanup",
         goals=("free disk space used by old rpm-ostree deployments", "clean up cached rpm-ostree data on {atomic}"),
         answers="$ sudo rpm-ostree cleanup -m\nremoves cached repository metadata.\n"
                 "$ sudo rpm-ostree cleanup -r\ndeletes the rollback deployment, and -p a pending "
                 "one. Only drop the rollback once the current deployment works well.",
         command="rpm-ostree cleanup -r",
         slots={"atomic": _ATOMIC}),
]

_BOOTC_IMAGES = ("quay.io/example/my-os:latest", "ghcr.io/acme/ai-node:stable",
                 "registry.example.com/infra/gpu-host:v2", "quay.io/fedora/fedora-bootc:42")
_BOOTC_BASES = ("quay.io/fedora/fedora-bootc:41", "quay.io/fedora/fedora-bootc:42",
                "quay.io/centos-bootc/centos-bootc:stream10")
_DISK_TYPES = ({"type": "qcow2", "use": "a virtual machine disk"}, {"type": "raw", "use": "a raw disk image"},
               {"type": "anaconda-iso", "use": "an installer ISO"})

BOOTC = [
    task("bootc.status",
         goals=("see which image my bootc host is running", "check the booted, staged and rollback images with bootc"),
         answers="$ sudo bootc status\nshows the image reference and digest of the booted "
                 "deployment, any staged update waiting for a reboot, and the rollback. The "
                 "image it tracks is what bootc upgrade pulls.",
         command="bootc status"),
    task("bootc.upgrade",
         goals=("update my bootc system to the newest version of its image", "check for bootc updates and apply them"),
         answers="$ sudo bootc upgrade\ndownloads the new version of the tracked image and stages "
                 "it for the next boot; reboot to apply. To only check for an update:\n"
                 "$ sudo bootc upgrade --check\nsudo bootc upgrade --apply stages and reboots in one step.",
         command="bootc upgrade"),
    task("bootc.switch",
         goals=("switch my bootc host to track {image}", "move a bootc machine to the image {image}"),
         answers="$ sudo bootc switch {image}\nThis pulls the image, stages it and makes it the "
                 "tracked image for future bootc upgrade runs. Reboot to boot into it; the "
                 "previous deployment stays as the rollback.",
         command="bootc switch {image}",
         slots={"image": _BOOTC_IMAGES}),
    task("bootc.rollback",
         goals=("go back to the previous image on a bootc host", "undo the last bootc upgrade"),
         answers="$ sudo bootc rollback\n$ systemctl reboot\nrollback swaps the boot order of the "
                 "current and rollback deployments, so the next boot uses the previous image. "
                 "bootc status shows which one will boot.",
         command="bootc rollback"),
    task("bootc.build",
         goals=("build a custom bootc image {image} based on {base} that adds {pkgs}",
                "bake {pkgs} into my own bootc OS image {image}"),
         answers="Write a Containerfile:\nFROM {base}\nRUN dnf -y install {pkgs} && dnf clean all\n"
                 "RUN bootc container lint\nBuild and push it:\n$ podman build -t {image} .\n"
                 "$ podman push {image}\nThen point hosts at it with sudo bootc switch {image}.",
         command="podman build -t {image} .",
         slots={"base": _BOOTC_BASES, "pkgs": ("nvtop htop", "tmux vim-enhanced", "cockpit", "podman-compose"),
                "image": _BOOTC_IMAGES[:3]}),
    task("bootc.disk_image",
         goals=("turn the bootc image {image} into {use}", "create a {type} file from my bootc image {image}"),
         answers="$ mkdir -p output\n$ sudo podman run --rm -it --privileged --pull=newer "
                 "--security-opt label=type:unconfined_t -v ./output:/output "
                 "-v /var/lib/containers/storage:/var/lib/containers/storage "
                 "quay.io/centos-bootc/bootc-image-builder:latest --type {type} {image}\n"
                 "The image must be in root's container storage (sudo podman pull {image}). "
                 "The result lands in ./output.",
         command="podman run --rm -it --privileged --pull=newer --security-opt label=type:unconfined_t "
                 "-v ./output:/output -v /var/lib/containers/storage:/var/lib/containers/storage "
                 "quay.io/centos-bootc/bootc-image-builder:latest --type {type} {image}",
         slots={"disk": _DISK_TYPES, "image": _BOOTC_IMAGES}),
    task("bootc.local_switch",
         goals=("boot a bootc image called {name} that I built locally without pushing it",
                "test my local bootc image {name} on this host"),
         answers="$ sudo podman build -t localhost/{name} .\n"
                 "$ sudo bootc switch --transport containers-storage localhost/{name}\n"
                 "bootc reads the image from root's container storage, so build it with sudo. "
                 "Reboot to use it, and switch back to a registry image afterwards.",
         command="bootc switch --transport containers-storage localhost/{name}",
         slots={"name": ("my-os", "gpu-node", "test-image")}),
    task("bootc.auto_updates",
         goals=("control the automatic updates on a bootc system", "stop a bootc host from rebooting for updates on its own"),
         answers="bootc ships bootc-fetch-apply-updates.timer, which periodically runs bootc "
                 "upgrade --apply and reboots when there is an update:\n"
                 "$ systemctl status bootc-fetch-apply-updates.timer\nDisable it if you schedule "
                 "updates yourself:\n$ sudo systemctl disable --now bootc-fetch-apply-updates.timer",
         command="systemctl disable --now bootc-fetch-apply-updates.timer"),
    task("bootc.lint",
         goals=("check my bootc Containerfile for common mistakes", "validate a bootc image while building it"),
         answers="Add this as the last step of the Containerfile:\nRUN bootc container lint\n"
                 "It fails the build on problems such as a missing or duplicate kernel or content "
                 "in /var that will not be updated. Run it by hand in a container with\n"
                 "$ podman run --rm {image} bootc container lint",
         command="bootc container lint",
         slots={"image": _BOOTC_IMAGES}),
]

_PROVIDES = ({"file": "/usr/bin/dig", "pkg": "bind-utils"}, {"file": "/usr/bin/iostat", "pkg": "sysstat"},
             {"file": "/usr/bin/semanage", "pkg": "policycoreutils-python-utils"},
             {"file": "/usr/bin/cpupower", "pkg": "kernel-tools"},
             {"file": "/usr/bin/smartctl", "pkg": "smartmontools"},
             {"file": "/usr/bin/audit2allow", "pkg": "policycoreutils-python-utils"},
             {"file": "/usr/bin/lsof", "pkg": "lsof"})
_COPRS = ({"copr": "atim/lazygit", "cpkg": "lazygit"}, {"copr": "atim/starship", "cpkg": "starship"},
          {"copr": "pgdev/ghostty", "cpkg": "ghostty"})
_OWNED_FILES = ("/etc/ssh/sshd_config", "/usr/bin/python3", "/usr/lib/systemd/system/sshd.service",
                "/etc/chrony.conf")

DNF = [
    task("dnf.install",
         goals=("install {pkg} on Fedora with dnf", "add the {pkg} package to my Fedora Workstation"),
         answers="$ sudo dnf install {pkg}\ndnf resolves and installs the dependencies; add -y to "
                 "skip the confirmation. dnf info {pkg} shows the version and repository first. "
                 "On Fedora Atomic use rpm-ostree install or a toolbox instead.",
         command="dnf install {pkg}",
         slots={"pkg": CLI_PACKAGES}),
    task("dnf.provides",
         goals=("find which package provides {file}", "figure out what to install to get {file}"),
         answers="$ dnf provides {file}\nFor {file} the answer is {pkg}, so install it with "
                 "sudo dnf install {pkg}. dnf provides also accepts globs such as '*/bin/NAME'.",
         command="dnf provides {file}",
         slots={"f": _PROVIDES}),
    task("dnf.no_match",
         goals=("find the right Fedora package name when dnf says {name} does not exist",),
         questions=(("dnf install {name} fails with this message. What is the right package?",
                     "Error: Unable to find a match: {name}"),),
         answers="Package names differ between distributions. Search by keyword:\n$ dnf search {term}\n"
                 "Here you most likely want {hint}. If you know a file the package ships, "
                 "dnf provides '*/FILENAME' finds the package too, and dnf info shows details.",
         command="dnf search {term}",
         slots={"n": ({"name": "python-pip", "term": "pip", "hint": "python3-pip"},
                      {"name": "docker-ce", "term": "docker", "hint": "podman or moby-engine"},
                      {"name": "python-dev", "term": "python3", "hint": "python3-devel"},
                      {"name": "nvidia-driver-550", "term": "nvidia",
                       "hint": "akmod-nvidia from RPM Fusion nonfree"})}),
    task("dnf.upgrade",
         goals=("update all packages on Fedora with fresh metadata", "install all pending updates with dnf"),
         answers="$ sudo dnf upgrade --refresh\n--refresh forces a metadata download, so you see "
                 "the newest updates. Reboot if the kernel, glibc or systemd were updated. "
                 "dnf history list shows what changed.",
         command="dnf upgrade --refresh"),
    task("dnf.history_undo",
         goals=("undo the dnf transaction {id}", "revert package transaction {id}, which broke something"),
         answers="$ dnf history list\n$ dnf history info {id}\n$ sudo dnf history undo {id}\n"
                 "undo reverses that transaction: installed packages are removed and removed ones "
                 "reinstalled, as long as the old versions are still in the repositories.",
         command="dnf history undo {id}",
         slots={"id": ("12", "27", "41", "58")}),
    task("dnf.copr",
         goals=("install {cpkg} from the COPR repository {copr}", "enable the COPR project {copr}"),
         answers="$ sudo dnf copr enable {copr}\n$ sudo dnf install {cpkg}\nCOPR repositories "
                 "are community builds that Fedora does not review, so only enable ones you "
                 "trust. Remove it later with sudo dnf copr remove {copr}.",
         command="dnf copr enable {copr}",
         slots={"c": _COPRS}),
    task("dnf.rpmfusion",
         goals=("enable the RPM Fusion free and nonfree repositories", "add RPM Fusion to get the NVIDIA driver on Fedora"),
         answers="$ sudo dnf install https://mirrors.rpmfusion.org/free/fedora/rpmfusion-free-release-"
                 "$(rpm -E %fedora).noarch.rpm https://mirrors.rpmfusion.org/nonfree/fedora/"
                 "rpmfusion-nonfree-release-$(rpm -E %fedora).noarch.rpm\n$(rpm -E %fedora) inserts "
                 "your release number. Nonfree is needed for akmod-nvidia. Afterwards run "
                 "sudo dnf upgrade --refresh so the new repositories are loaded.",
         command="dnf install https://mirrors.rpmfusion.org/free/fedora/rpmfusion-free-release-"
                 "$(rpm -E %fedora).noarch.rpm"),
    task("dnf.owner",
         goals=("find which installed package owns {path}", "check which RPM a file like {path} came from"),
         answers="$ rpm -qf {path}\nprints the package that installed the file. rpm -qi PACKAGE "
                 "shows its details and rpm -V PACKAGE lists files changed since installation.",
         command="rpm -qf {path}",
         slots={"path": _OWNED_FILES}),
    task("dnf.system_upgrade",
         goals=("upgrade Fedora Workstation to release {ver}", "move my dnf-based Fedora install to version {ver}"),
         answers="1. Update the current release first:\n$ sudo dnf upgrade --refresh\n"
                 "2. Download the new release:\n$ sudo dnf system-upgrade download --releasever={ver}\n"
                 "3. Reboot into the offline upgrade:\n$ sudo dnf system-upgrade reboot\n"
                 "Back up important data first.",
         command="dnf system-upgrade download --releasever={ver}",
         slots={"ver": ("41", "42")}),
    task("dnf.nvidia_driver",
         goals=("install the NVIDIA driver with CUDA support on Fedora", "set up the proprietary NVIDIA driver from RPM Fusion"),
         answers="With RPM Fusion nonfree enabled:\n$ sudo dnf install akmod-nvidia xorg-x11-drv-nvidia-cuda\n"
                 "Wait a few minutes for akmods to build the kernel module, then check:\n"
                 "$ modinfo -F version nvidia\nReboot once it prints a version. With Secure Boot "
                 "the module must be signed with an enrolled key.",
         command="dnf install akmod-nvidia xorg-x11-drv-nvidia-cuda"),
    task("dnf.repoquery",
         goals=("list what {pkg} depends on without installing it", "see which packages {pkg} requires"),
         answers="$ dnf repoquery --requires {pkg}\nrepoquery reads the repository metadata, so "
                 "nothing is downloaded or installed. The reverse question, which packages need "
                 "{pkg}, is answered by dnf repoquery --whatrequires {pkg}; add --installed to "
                 "look only at installed packages.",
         command="dnf repoquery --requires {pkg}",
         slots={"pkg": CLI_PACKAGES}),
    task("dnf.versionlock",
         goals=("keep {pkg} at its current version during updates", "stop dnf from upgrading {pkg}"),
         answers="$ sudo dnf versionlock add {pkg}\ndnf upgrade then leaves it alone. List locks "
                 "with dnf versionlock list and remove one with dnf versionlock delete {pkg}. "
                 "Older dnf4 needs the python3-dnf-plugin-versionlock package.",
         command="dnf versionlock add {pkg}",
         slots={"pkg": ("kernel", "podman", "nvidia-driver", "mesa-dri-drivers")}),
]

_RENDER_NODES = ({"render": "renderD128", "card": "the first GPU"}, {"render": "renderD129", "card": "the second GPU"})
_ROCM_COMMANDS = ("rocminfo", "rocm-smi")
_QUADLETS = (
    {"name": "llama", "image": "ghcr.io/ggml-org/llama.cpp:server-cuda", "devices": "AddDevice=nvidia.com/gpu=all",
     "exec": "Exec=-m /models/model.gguf --host 0.0.0.0 --port 8080 -ngl 99",
     "volume": "Volume=/srv/models:/models:z", "port": "8080"},
    {"name": "llama-rocm", "image": "ghcr.io/ggml-org/llama.cpp:server-rocm",
     "devices": "AddDevice=/dev/kfd\nAddDevice=/dev/dri",
     "exec": "Exec=-m /models/model.gguf --host 0.0.0.0 --port 8080 -ngl 99",
     "volume": "Volume=/srv/models:/models:z", "port": "8080"},
    {"name": "vllm", "image": "docker.io/vllm/vllm-openai:latest", "devices": "AddDevice=nvidia.com/gpu=all",
     "exec": "Exec=--model Qwen/Qwen2.5-1.5B-Instruct",
     "volume": "Volume=%h/.cache/huggingface:/root/.cache/huggingface:z", "port": "8000"},
)

GPU_CONTAINERS = [
    task("gpu_containers.nvidia_cdi",
         goals=("give a podman container running {image} access to all my NVIDIA GPUs",
                "run {image} with NVIDIA GPUs using CDI"),
         answers=("1. Install nvidia-container-toolkit and generate the CDI spec:\n"
                  "$ sudo nvidia-ctk cdi generate --output=/etc/cdi/nvidia.yaml\n"
                  "2. Check the device names it created:\n$ nvidia-ctk cdi list\n"
                  "3. Run a container with all GPUs:\n"
                  "$ podman run --rm --device nvidia.com/gpu=all --security-opt=label=disable {image} nvidia-smi\n"
                  "label=disable avoids SELinux denials on the device files.",
                  "Podman uses CDI for NVIDIA GPUs, no special runtime needed:\n"
                  "$ podman run --rm --device nvidia.com/gpu=all --security-opt=label=disable {image} nvidia-smi\n"
                  "If it reports unresolvable CDI devices, create the spec with "
                  "sudo nvidia-ctk cdi generate --output=/etc/cdi/nvidia.yaml."),
         command="podman run --rm --device nvidia.com/gpu=all --security-opt=label=disable {image} nvidia-smi",
         slots={"image": CUDA_IMAGES},
         brief="$ podman run --rm --device nvidia.com/gpu=all --security-opt=label=disable {image} nvidia-smi\n"
               "Podman reaches NVIDIA GPUs through CDI; create the spec once with "
               "sudo nvidia-ctk cdi generate --output=/etc/cdi/nvidia.yaml."),
    task("gpu_containers.nvidia_one",
         goals=("expose only GPU {gpu} to a podman container running {image}",
                "run {image} so that it sees just NVIDIA GPU {gpu}"),
         answers="CDI names every GPU by index (and by UUID):\n"
                 "$ podman run --rm --device nvidia.com/gpu={gpu} --security-opt=label=disable {image} nvidia-smi -L\n"
                 "Inside the container it shows up as GPU 0. Repeat --device to pass several GPUs; "
                 "nvidia-ctk cdi list shows the valid names.",
         command="podman run --rm --device nvidia.com/gpu={gpu} --security-opt=label=disable {image} nvidia-smi -L",
         slots={"gpu": GPU_IDS, "image": CUDA_IMAGES}),
    task("gpu_containers.amd",
         goals=("run {cmd} in a ROCm container from {image} with access to my AMD GPU",
                "use my Radeon GPU inside {image} to run {cmd}"),
         answers="ROCm needs the compute interface /dev/kfd and the render nodes in /dev/dri:\n"
                 "$ podman run --rm -it --device /dev/kfd --device /dev/dri --group-add keep-groups "
                 "--security-opt seccomp=unconfined {image} {cmd}\n"
                 "--group-add keep-groups keeps your host render and video groups in a rootless "
                 "container. If SELinux blocks the devices, add --security-opt label=disable.",
         command="podman run --rm -it --device /dev/kfd --device /dev/dri --group-add keep-groups "
                 "--security-opt seccomp=unconfined {image} {cmd}",
         slots={"image": ROCM_IMAGES, "cmd": _ROCM_COMMANDS}),
    task("gpu_containers.amd_one",
         goals=("give a container from {image} only {card} of my AMD GPUs",
                "pass just one AMD GPU, {render}, into a podman container running {image}"),
         answers="Pass /dev/kfd plus only that GPU's render node instead of all of /dev/dri:\n"
                 "$ podman run --rm -it --device /dev/kfd --device /dev/dri/{render} "
                 "--group-add keep-groups {image} rocm-smi\nls -l /dev/dri/by-path shows which "
                 "renderD node belongs to which PCI device.",
         command="podman run --rm -it --device /dev/kfd --device /dev/dri/{render} --group-add keep-groups {image} rocm-smi",
         slots={"node": _RENDER_NODES, "image": ROCM_IMAGES}),
    task("gpu_containers.cdi_error",
         goals=("fix the unresolvable CDI devices error from podman",),
         questions=(("podman run --device nvidia.com/gpu=all fails with this error. What's wrong?",
                     "Error: setting up CDI devices: unresolvable CDI devices nvidia.com/gpu=all"),
                    "My GPU containers stopped working after an NVIDIA driver update. What should I regenerate?"),
         answers="Podman can't find a valid CDI spec for the NVIDIA GPUs. Generate it again (also "
                 "after every driver update):\n$ sudo nvidia-ctk cdi generate --output=/etc/cdi/nvidia.yaml\n"
                 "$ nvidia-ctk cdi list\nThe list must include nvidia.com/gpu=all. Then rerun the container.",
         command="nvidia-ctk cdi generate --output=/etc/cdi/nvidia.yaml"),
    task("gpu_containers.quadlet",
         goals=("run the {name} GPU container as a systemd service with a quadlet file",
                "start {image} automatically with quadlet and GPU access"),
         answers="Create ~/.config/containers/systemd/{name}.container:\n[Container]\nImage={image}\n"
                 "{devices}\nSecurityLabelDisable=true\n{volume}\nPublishPort={port}:{port}\n{exec}\n\n"
                 "[Install]\nWantedBy=default.target\n\nThen generate and start the service:\n"
                 "$ systemctl --user daemon-reload\n$ systemctl --user start {name}.service",
         command="systemctl --user start {name}.service",
         slots={"q": _QUADLETS}),
    task("gpu_containers.groups",
         goals=("fix permission denied on /dev/kfd for {user} inside a rootless container",),
         questions=("Inside a rootless container rocminfo fails for {user} with permission denied on /dev/kfd. "
                    "What should I check?",
                    "{user} can't use the AMD GPU from podman. Which groups does the account need?"),
         answers="On the host /dev/kfd and /dev/dri/renderD* belong to the render group (some "
                 "nodes to video). Add the user and log in again:\n$ sudo usermod -aG render,video {user}\n"
                 "Then keep the groups in the container:\n"
                 "$ podman run --rm --device /dev/kfd --device /dev/dri --group-add keep-groups {image} rocminfo\n"
                 "If it still fails, look for SELinux denials with ausearch -m AVC -ts recent.",
         command="usermod -aG render,video {user}",
         slots={"user": ("alice", "bob", "mlops", "dana"), "image": ROCM_IMAGES}),
    task("gpu_containers.selinux",
         goals=("use GPUs in containers without disabling SELinux labeling",),
         questions=("Is there a better way than --security-opt=label=disable for GPU containers on Fedora?",),
         answers="Keep labeling on and allow confined containers to use devices instead:\n"
                 "$ sudo setsebool -P container_use_devices on\nThen run without label=disable:\n"
                 "$ podman run --rm --device nvidia.com/gpu=all {image} nvidia-smi\n"
                 "The boolean applies to all containers, so it is still a trade-off, but less "
                 "drastic than turning labels off.",
         command="setsebool -P container_use_devices on",
         slots={"image": CUDA_IMAGES}),
]

_GFX_OVERRIDES = ({"card": "Radeon RX 6700 XT", "gfx": "10.3.0", "target": "gfx1030"},
                  {"card": "Radeon RX 6600", "gfx": "10.3.0", "target": "gfx1030"},
                  {"card": "Radeon RX 7600", "gfx": "11.0.0", "target": "gfx1100"},
                  {"card": "Radeon 780M iGPU", "gfx": "11.0.0", "target": "gfx1100"})
_ROCM_METRICS = ({"flag": "--showtemp", "what": "temperature"}, {"flag": "--showpower", "what": "power draw"},
                 {"flag": "--showuse", "what": "utilization"}, {"flag": "--showfan", "what": "fan speed"},
                 {"flag": "--showclocks", "what": "clock speeds"})
_AMD_SMI = ({"sub": "list", "what": "list the AMD GPUs with their PCI address and UUID"},
            {"sub": "monitor", "what": "monitor power, temperature, utilization and VRAM live"},
            {"sub": "process", "what": "see which processes use the AMD GPU"},
            {"sub": "static", "what": "show static details of the AMD GPU such as ASIC and VBIOS"},
            {"sub": "metric", "what": "show current AMD GPU metrics such as usage, power and clocks"})
_VISIBLE = ("0", "1", "0,1", "2,3")

ROCM = [
    task("rocm.vram",
         goals=("check how much VRAM is used on my AMD GPU", "see the VRAM usage of AMD GPU {gpu}"),
         answers="$ rocm-smi --showmeminfo vram\nshows total and used VRAM per GPU. Limit it to "
                 "one card with -d, for example rocm-smi -d {gpu} --showmeminfo vram; "
                 "rocm-smi --showmemuse prints a percentage instead.",
         command="rocm-smi --showmeminfo vram",
         slots={"gpu": GPU_IDS}),
    task("rocm.metric",
         goals=("show the {what} of my AMD GPU with rocm-smi", "watch the GPU {what} on a ROCm machine"),
         answers="$ rocm-smi {flag}\nFor a live view:\n$ watch -n 1 rocm-smi {flag}\nWithout "
                 "options rocm-smi prints a summary table with temperature, power, clocks, fan, "
                 "VRAM and utilization for every GPU.",
         command="rocm-smi {flag}",
         slots={"m": _ROCM_METRICS}),
    task("rocm.gfx_target",
         goals=("find the gfx target name of my AMD GPU", "check which ISA my Radeon card reports to ROCm"),
         answers="$ rocminfo | grep -i gfx\nEvery GPU agent reports a name such as gfx1100 "
                 "(RDNA3) or gfx90a (MI200). You need it for build flags like "
                 "-DAMDGPU_TARGETS=gfx1100 and to check ROCm support. If only CPU agents appear, "
                 "check /dev/kfd permissions and the amdgpu driver.",
         command="rocminfo | grep -i gfx"),
    task("rocm.amd_smi",
         goals=("{what} with amd-smi",),
         answers="$ amd-smi {sub}\namd-smi is the newer tool that replaces rocm-smi from ROCm 6 "
                 "on. Select a single GPU with -g, for example amd-smi {sub} -g {gpu}, and get "
                 "machine-readable output with --json.",
         command="amd-smi {sub}",
         slots={"s": _AMD_SMI, "gpu": GPU_IDS}),
    task("rocm.hsa_override",
         goals=("run ROCm on my {card}, which is not officially supported", "make PyTorch with ROCm work on a {card}"),
         answers="Many consumer GPUs work when ROCm treats them as the closest supported target:\n"
                 "$ HSA_OVERRIDE_GFX_VERSION={gfx} python train.py\n{gfx} maps to the {target} "
                 "ISA. It is unsupported, so test carefully; a wrong value makes kernels fail to "
                 "load. Set it in the service or container environment to keep it.",
         command="HSA_OVERRIDE_GFX_VERSION={gfx} python train.py",
         slots={"g": _GFX_OVERRIDES}),
    task("rocm.visible",
         goals=("make a ROCm program use only GPU {ids}", "hide all AMD GPUs except {ids} from my training job"),
         answers="$ HIP_VISIBLE_DEVICES={ids} python train.py\nThe selected GPUs are renumbered "
                 "from 0 inside the process. ROCR_VISIBLE_DEVICES does the same one level lower in "
                 "the ROCm runtime; HIP also honours CUDA_VISIBLE_DEVICES.",
         command="HIP_VISIBLE_DEVICES={ids} python train.py",
         slots={"ids": _VISIBLE}),
    task("rocm.torch_check",
         goals=("check that PyTorch sees my AMD GPU through ROCm", "verify that my PyTorch install is a ROCm build"),
         answers="$ python -c \"import torch; print(torch.cuda.is_available(), torch.version.hip)\"\n"
                 "ROCm builds of PyTorch reuse the torch.cuda API, so is_available() should print "
                 "True and torch.version.hip a version. If hip is None, you installed a CUDA or CPU "
                 "wheel; reinstall from the ROCm index of download.pytorch.org.",
         command="python -c \"import torch; print(torch.cuda.is_available(), torch.version.hip)\""),
    task("rocm.no_agent",
         goals=("find out why rocminfo cannot open my AMD GPU",),
         questions=(("rocminfo fails with this message. What should I check?",
                     "Call returned HSA_STATUS_ERROR_OUT_OF_RESOURCES: The runtime failed to "
                     "allocate the necessary resources."),
                    "rocminfo only lists my CPU as an agent, not the Radeon GPU. What is wrong?"),
         answers="Usually the user cannot open the GPU device nodes.\n1. Check the driver is loaded:\n"
                 "$ lsmod | grep amdgpu\n2. Check the device nodes and your groups:\n"
                 "$ ls -l /dev/kfd /dev/dri/renderD*\n$ groups\n3. Join render and video, then "
                 "log in again:\n$ sudo usermod -aG render,video $USER",
         command="ls -l /dev/kfd /dev/dri/renderD*"),
    task("rocm.pids",
         goals=("see which processes are using my AMD GPU", "find the program that holds VRAM on the AMD GPU"),
         answers="$ rocm-smi --showpids\nlists the PIDs with a GPU context and their VRAM use. "
                 "amd-smi process gives the same with more detail. Stop the process if it is a "
                 "leftover job.",
         command="rocm-smi --showpids"),
    task("rocm.product",
         goals=("find the product name and driver version of my AMD GPUs", "identify which AMD GPU model is installed"),
         answers="$ rocm-smi --showproductname\nprints the card series, model and vendor for every "
                 "GPU, and\n$ rocm-smi --showdriverversion\nthe amdgpu driver version. lspci -nn | "
                 "grep -i vga also works without ROCm.",
         command="rocm-smi --showproductname"),
    task("rocm.fedora_install",
         goals=("install the ROCm runtime tools from the Fedora repositories", "get rocminfo and rocm-smi on Fedora"),
         answers="Fedora packages ROCm itself:\n$ sudo dnf install rocminfo rocm-smi rocm-hip\n"
                 "Add your user to the render and video groups, log in again, and check with "
                 "rocminfo. On Fedora Atomic install them with rpm-ostree or inside a toolbox.",
         command="dnf install rocminfo rocm-smi rocm-hip"),
]

_QUERIES = ({"fields": "name,memory.used,memory.total", "what": "memory usage"},
            {"fields": "index,utilization.gpu,temperature.gpu", "what": "utilization and temperature"},
            {"fields": "name,driver_version", "what": "the driver version"},
            {"fields": "index,power.draw,power.limit", "what": "power draw and limit"},
            {"fields": "index,name,uuid", "what": "the UUID"})
_ARCHS = ({"sm": "80", "gpu": "an A100", "cc": "8.0"}, {"sm": "86", "gpu": "an RTX 3090", "cc": "8.6"},
          {"sm": "89", "gpu": "an RTX 4090", "cc": "8.9"}, {"sm": "90", "gpu": "an H100", "cc": "9.0"},
          {"sm": "75", "gpu": "a T4", "cc": "7.5"})

CUDA = [
    task("cuda.query",
         goals=("print {what} for each NVIDIA GPU as CSV", "get {what} of my NVIDIA GPUs in a script-friendly format"),
         answers="$ nvidia-smi --query-gpu={fields} --format=csv\nUse --format=csv,noheader,nounits "
                 "for scripts and -l 5 to repeat every 5 seconds. nvidia-smi --help-query-gpu lists "
                 "every field; plain nvidia-smi shows the same data as a table for humans.",
         command="nvidia-smi --query-gpu={fields} --format=csv",
         slots={"q": _QUERIES}),
    task("cuda.processes",
         goals=("list the processes using GPU memory with nvidia-smi", "find which process holds memory on my NVIDIA GPU"),
         answers="$ nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv\n"
                 "The plain nvidia-smi table shows the same at the bottom. Processes in containers "
                 "may show PIDs of another namespace or none at all.",
         command="nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv"),
    task("cuda.nvcc",
         goals=("compile {name}.cu for {gpu} with nvcc", "build the CUDA program {name}.cu for compute capability {cc}"),
         answers="$ nvcc --version\nconfirms the toolkit version. Build for compute capability "
                 "{cc} (sm_{sm}):\n$ nvcc -O2 -arch=sm_{sm} -o {name} {name}.cu\n$ ./{name}\n"
                 "The toolkit must know the architecture, and the driver must be at least as new "
                 "as the toolkit.",
         command="nvcc -O2 -arch=sm_{sm} -o {name} {name}.cu",
         slots={"a": _ARCHS, "name": ("vector_add", "matmul", "saxpy", "reduce")}),
    task("cuda.visible",
         goals=("make a training script use only GPU {ids}", "hide every NVIDIA GPU except {ids} from a process"),
         answers="$ CUDA_VISIBLE_DEVICES={ids} python train.py\nCUDA renumbers the visible GPUs "
                 "from 0, so inside the process they are cuda:0 and up. Set "
                 "CUDA_DEVICE_ORDER=PCI_BUS_ID too if the numbering must match nvidia-smi.",
         command="CUDA_VISIBLE_DEVICES={ids} python train.py",
         slots={"ids": _VISIBLE}),
    task("cuda.power_limit",
         goals=("cap the power draw of GPU {gpu} at {watts} W", "lower the power limit of NVIDIA GPU {gpu} to {watts} watts"),
         answers="$ sudo nvidia-smi -i {gpu} -pl {watts}\nThe value must lie in the range shown by "
                 "nvidia-smi -q -d POWER. It resets at reboot, so apply it from a oneshot systemd "
                 "service. Persistence mode keeps the driver loaded between jobs:\n$ sudo nvidia-smi -pm 1",
         command="nvidia-smi -i {gpu} -pl {watts}",
         slots={"gpu": GPU_IDS, "watts": ("250", "300", "350")}),
    task("cuda.torch_oom",
         goals=("reduce GPU memory use when PyTorch runs out of CUDA memory",),
         questions=(("My training run crashes with this error. How can I make it fit?",
                     "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate {gib} GiB."),),
         answers="1. Make sure no other process holds GPU memory:\n"
                 "$ nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv\n"
                 "2. Lower the batch size (use gradient accumulation to keep the effective size), "
                 "train in bfloat16 and enable gradient checkpointing.\n"
                 "3. Against fragmentation, set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True.",
         command="nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv",
         slots={"gib": ("1.50", "2.00", "4.00", "512.00")}),
    task("cuda.topology",
         goals=("see how my NVIDIA GPUs are connected to each other", "check whether my GPUs talk over NVLink or PCIe"),
         answers="$ nvidia-smi topo -m\nThe matrix shows NV# for NVLink, PIX or PXB for PCIe "
                 "switches, PHB through the host bridge and SYS across CPU sockets, plus the CPU "
                 "and NUMA affinity of each GPU. Put communicating processes on NVLink pairs.",
         command="nvidia-smi topo -m"),
    task("cuda.dmon",
         goals=("stream utilization and power samples for GPU {gpu}", "log the utilization of NVIDIA GPU {gpu} once per second"),
         answers="$ nvidia-smi dmon -i {gpu} -s pu\nprints one line per second with power and "
                 "temperature (p) and SM, memory, encoder and decoder utilization (u). Add -c 30 "
                 "to stop after 30 samples.",
         command="nvidia-smi dmon -i {gpu} -s pu",
         slots={"gpu": GPU_IDS}),
    task("cuda.torch_check",
         goals=("check that PyTorch can use my NVIDIA GPU", "verify that my PyTorch install was built with CUDA"),
         answers="$ python -c \"import torch; print(torch.cuda.is_available(), torch.cuda.device_count(), torch.version.cuda)\"\n"
                 "False with torch.version.cuda set to None means a CPU-only wheel. False with a "
                 "version usually means the driver is missing or too old; check nvidia-smi.",
         command="python -c \"import torch; print(torch.cuda.is_available(), torch.cuda.device_count(), torch.version.cuda)\""),
    task("cuda.throttle",
         goals=("find out why NVIDIA GPU {gpu} is throttling", "see the current clocks and throttle reasons of GPU {gpu}"),
         answers="$ nvidia-smi -q -d PERFORMANCE -i {gpu}\nlists the active clock throttle reasons "
                 "such as power cap or thermal slowdown.\n$ nvidia-smi -q -d CLOCK -i {gpu}\n"
                 "shows current versus maximum clocks. Check cooling and the power limit first.",
         command="nvidia-smi -q -d PERFORMANCE -i {gpu}",
         slots={"gpu": GPU_IDS}),
    task("cuda.versions",
         goals=("check which NVIDIA driver and CUDA toolkit versions are installed", "compare the CUDA driver and toolkit versions"),
         answers="$ nvidia-smi\nThe header shows the driver version and the highest CUDA version "
                 "that driver supports.\n$ nvcc --version\nshows the installed toolkit, which must "
                 "not be newer than the driver supports.",
         command="nvcc --version"),
]

TASKS = OSTREE + BOOTC + DNF + GPU_CONTAINERS + ROCM + CUDA
