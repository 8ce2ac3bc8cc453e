"""Building blocks for the synthetic instruction data in :mod:`hivetune.data.synth`.

A :class:`Task` is one thing a user may want to do ("open a port in firewalld"). It carries

* ``goals``: infinitive verb phrases ("open port {port}/{proto} in firewalld") that are combined
  with the generic question forms in :data:`GOAL_FORMS` ("How do I {goal}?"),
* ``questions``: complete, task-specific questions (explain..., my X fails with Y...), each with
  an optional ``input`` text such as an error message,
* ``answers``: one or more answer templates that all teach the same key ``command``,
* ``slots``: the values that fill ``{name}`` placeholders. A slot value is either a string or a
  dict; a dict sets several placeholders at once, which keeps related values consistent (a GPU
  model and its compute capability, a port and its protocol). A value may itself mention other
  placeholders (an error message containing ``{port}``); they are filled in one extra pass.

Every placeholder used by ``command`` must be named by each goal and question (directly, or via a
key of the same dict slot), so the reference command can be derived from the question alone.

Answer convention (used by every template, and checked by the tests): each shell command stands
on its own line starting with ``$ `` (``sudo`` included where root is needed), each Python
statement on its own line starting with ``>>> ``. File contents (unit files, Containerfiles) are
plain lines. The ``command`` of a task is written without ``sudo`` so that it is a verbatim
substring of the ``$ sudo ...`` line.

The per-category tasks live in the ``synth_topics_*`` modules; this module holds what they share.
"""

from __future__ import annotations

from dataclasses import dataclass

@dataclass(frozen=True)
class Task:
    """One user intent with its question templates, answer templates and slot values."""

    key: str  # "<category>.<name>", unique over all tasks
    goals: tuple[str, ...]
    questions: tuple[tuple[str, str], ...]  # (instruction template, input template)
    answers: tuple[str, ...]
    command: str
    slots: tuple[tuple[str, tuple], ...]  # ordered (name, values) pairs; order fixes rng use
    # The short answer of the shipped default dataset, where the derived one
    # (``synth.brief_answer``: the key command line, then one sentence of the answer) reads badly.
    brief: str = ""

    @property
    def category(self) -> str:
        return self.key.split(".", 1)[0]


def task(key: str, *, goals=(), questions=(), answers, command: str, slots=None, brief: str = "") -> Task:
    """Build a :class:`Task`, normalising the convenient literal forms used in topic modules.

    ``questions`` entries may be plain strings (no input) or ``(instruction, input)`` pairs;
    ``answers`` may be a single string; ``slots`` is a dict of name -> sequence of values;
    ``brief`` (optional) is the short answer template of the shipped default dataset.
    """
    if isinstance(answers, str):
        answers = (answers,)
    normalised_questions = tuple((q, "") if isinstance(q, str) else (q[0], q[1]) for q in questions)
    if not goals and not normalised_questions:
        raise ValueError(f"task {key!r} needs at least one goal or question")
    slot_pairs = tuple((name, tuple(values)) for name, values in (slots or {}).items())
    for name, values in slot_pairs:
        if not values:
            raise ValueError(f"task {key!r}: slot {name!r} has no values")
    return Task(key, tuple(goals), normalised_questions, tuple(answers), command, slot_pairs, brief)


# Generic ways to ask for a goal. Each must read naturally with any goal phrase, which is an
# infinitive verb phrase starting in lower case ("open port 8080/tcp in firewalld").
GOAL_FORMS = (
    "How do I {goal}?",
    "How can I {goal}?",
    "What's the command to {goal}?",
    "What command should I run to {goal}?",
    "I need to {goal}. What should I run?",
    "Show me how to {goal}.",
    "What is the correct way to {goal}?",
    "Give me the steps to {goal}.",
    "What's the best way to {goal}?",
    "Quick question: how do I {goal}?",
    "Is there a simple way to {goal}?",
    "Walk me through how to {goal}.",
    "I'm on Fedora. How do I {goal}?",
    "Please explain how to {goal}.",
    "Can you tell me how to {goal}?",
    "I want to {goal}; which commands do I need?",
)

# ---------------------------------------------------------------------------------------------
# Shared slot pools. Values are realistic but made up (users, hosts, paths).
# ---------------------------------------------------------------------------------------------

SYSTEM_SERVICES = ("nginx", "httpd", "sshd", "redis", "postgresql", "chronyd", "NetworkManager",
                   "firewalld", "crond", "tuned")
APP_SERVICES = ("llama-server", "vllm", "inference-api", "jupyter", "webhook-receiver",
                "metrics-agent", "model-sync", "backup-agent")
ANY_SERVICES = SYSTEM_SERVICES + APP_SERVICES

USERS = ("alice", "bob", "carol", "deploy", "mlops", "dana", "ravi", "priya", "ci-runner", "svc-llm")
GROUPS = ("developers", "mlteam", "ops", "data", "render", "video", "analysts")
HOSTS = ("gpu01", "gpu02.lab.example.com", "build-server", "10.0.0.15", "node3.example.net",
         "train-box", "192.168.1.40", "inference01.example.com")
PIDS = ("1234", "4821", "23817", "9906", "31337", "7702")

# Directories that hold data or web content; none are special system paths.
DATA_DIRS = ("/srv/data", "/srv/models", "/data/datasets", "/opt/llm", "/var/lib/app",
             "/srv/shared", "/home/alice/projects")
WEB_DIRS = ("/srv/www", "/srv/site", "/var/www/blog", "/data/web", "/opt/portal/public",
            "/srv/static")

MEMORY_SIZES = ("512M", "1G", "2G", "4G", "8G", "16G")

# Fedora packages that exist in the main repositories.
CLI_PACKAGES = ("htop", "tmux", "nvtop", "zsh", "fish", "vim-enhanced", "wireguard-tools",
                "strace", "smartmontools", "btop", "ripgrep", "jq", "git-lfs", "sysstat")

HF_MODELS = ("Qwen/Qwen2.5-7B-Instruct", "meta-llama/Llama-3.1-8B-Instruct",
             "mistralai/Mistral-7B-Instruct-v0.3", "microsoft/Phi-3.5-mini-instruct",
             "google/gemma-2-9b-it", "Qwen/Qwen2.5-1.5B-Instruct",
             "HuggingFaceTB/SmolLM2-1.7B-Instruct")
SMALL_HF_MODELS = ("HuggingFaceTB/SmolLM2-135M-Instruct", "Qwen/Qwen2.5-0.5B-Instruct",
                   "TinyLlama/TinyLlama-1.1B-Chat-v1.0", "meta-llama/Llama-3.2-1B-Instruct",
                   "HuggingFaceTB/SmolLM2-360M-Instruct")
GGUF_FILES = ("qwen2.5-7b-instruct-q4_k_m.gguf", "Llama-3.2-3B-Instruct-Q4_K_M.gguf",
              "mistral-7b-instruct-v0.3.Q5_K_M.gguf", "gemma-2-2b-it-Q8_0.gguf",
              "Phi-3.5-mini-instruct-Q4_K_M.gguf", "SmolLM2-1.7B-Instruct-Q4_K_M.gguf")

GPU_IDS = ("0", "1", "2", "3")
CUDA_IMAGES = ("docker.io/nvidia/cuda:12.4.1-base-ubuntu22.04",
               "docker.io/nvidia/cuda:12.2.0-base-ubuntu22.04")
ROCM_IMAGES = ("docker.io/rocm/dev-ubuntu-22.04", "docker.io/rocm/pytorch:latest")

PROMPTS = ("Hello!", "Summarize what SELinux does in one sentence.", "Write a haiku about GPUs.",
           "What is the capital of France?", "Explain LoRA in two sentences.")
