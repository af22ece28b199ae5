"""titan-core: config machinery, ParallelDims and device meshes, device and process-group setup,
logging, and the protocols and registries the other Titan packages plug into."""

import importlib.metadata
from typing import TYPE_CHECKING

from titan_core.lazy import attach

# The public API, each name imported from its module on first use (titan_core.lazy): a
# light module of the package loads without the others, and torch with them.
if TYPE_CHECKING:
    from titan_core.config import (
        ConfigError,
        allow_nonfinite,
        config_to_dict,
        field_docs,
        iter_options,
        load_config,
        render_help,
        to_toml,
        validate,
    )
    from titan_core.device import (
        DEVICE_MEMORY_GIB,
        backend_for,
        device_memory_gib,
        device_name,
        local_device,
        resolve_device_type,
        supports_bf16,
    )
    from titan_core.distributed import (
        DistInfo,
        any_rank,
        destroy_distributed,
        dump_flight_recorder,
        init_distributed,
        set_collective_timeout,
        world_size_from_env,
    )
    from titan_core.flops import (
        PEAK_TFLOPS,
        CpuBound,
        PeakFlops,
        cpu_peak_bound,
        lookup_peak_flops,
        measure_matmul_flops,
        peak_cache_file,
        peak_flops,
        two_significant,
    )
    from titan_core.init import ParamInit, init_from_plan_, init_parameter_
    from titan_core.log import get_logger, init_logging
    from titan_core.memory import MemoryMonitor, MemoryStats
    from titan_core.messages import first_line, shortlist
    from titan_core.network import interface_towards, point_gloo_at
    from titan_core.parallel_dims import ParallelDims, dp_coordinates
    from titan_core.plugins import PluginError, available, resolve
    from titan_core.progress import Progress
    from titan_core.protocols import (
        GLOBAL_STATE,
        Checkpointer,
        CheckpointerFactory,
        CheckpointerPlugin,
        CheckpointError,
        Converter,
        DataSpec,
        ExpertSplit,
        HFAdapter,
        HFSlice,
        LoaderBase,
        ModelSpec,
        MoEPlan,
        NamesItsOption,
        OptimizerFactory,
        OptimizerPlugin,
        ParallelizableModel,
        SelfSchedulingOptimizer,
        SlicedHFAdapter,
        Stateful,
        StatefulLoader,
        StateMismatchError,
        Tokenizer,
        TPPlan,
        TPStyle,
        build_hf_adapter,
        is_sliced_hf_adapter,
        parallelizable_problems,
    )
    from titan_core.run_folder import FolderLock, RunFolderError, check_writable
    from titan_core.sections import Comm, Job
    from titan_core.seed import set_seed
    from titan_core.versions import version_text

__getattr__, __dir__ = attach(__name__, __file__)

__version__ = importlib.metadata.version("titan-llm-core")  # the pyproject's version, one source

__all__ = [
    "DEVICE_MEMORY_GIB",
    "ParamInit",
    "device_memory_gib",
    "init_from_plan_",
    "init_parameter_",
    "PEAK_TFLOPS",
    "Checkpointer",
    "CheckpointerFactory",
    "CheckpointerPlugin",
    "Comm",
    "CheckpointError",
    "ConfigError",
    "allow_nonfinite",
    "Converter",
    "OptimizerFactory",
    "OptimizerPlugin",
    "SelfSchedulingOptimizer",
    "LoaderBase",
    "NamesItsOption",
    "CpuBound",
    "DataSpec",
    "DistInfo",
    "FolderLock",
    "HFAdapter",
    "HFSlice",
    "SlicedHFAdapter",
    "is_sliced_hf_adapter",
    "build_hf_adapter",
    "Job",
    "MemoryMonitor",
    "MemoryStats",
    "ModelSpec",
    "MoEPlan",
    "ExpertSplit",
    "ParallelDims",
    "dp_coordinates",
    "ParallelizableModel",
    "PeakFlops",
    "PluginError",
    "Progress",
    "RunFolderError",
    "Stateful",
    "StateMismatchError",
    "StatefulLoader",
    "GLOBAL_STATE",
    "TPPlan",
    "TPStyle",
    "Tokenizer",
    "any_rank",
    "available",
    "backend_for",
    "check_writable",
    "config_to_dict",
    "cpu_peak_bound",
    "destroy_distributed",
    "dump_flight_recorder",
    "device_name",
    "field_docs",
    "first_line",
    "interface_towards",
    "point_gloo_at",
    "get_logger",
    "init_distributed",
    "init_logging",
    "iter_options",
    "load_config",
    "local_device",
    "lookup_peak_flops",
    "measure_matmul_flops",
    "peak_cache_file",
    "parallelizable_problems",
    "peak_flops",
    "render_help",
    "resolve",
    "resolve_device_type",
    "set_collective_timeout",
    "set_seed",
    "shortlist",
    "supports_bf16",
    "to_toml",
    "two_significant",
    "validate",
    "version_text",
    "world_size_from_env",
]
