//! Finding and loading libcudart and libnccl at run time, once per process, on first use.
//!
//! Lookup order, for each library: the path in its setting (`RVOD_CUDA_LIBRARY`, `RVOD_NCCL_LIBRARY`),
//! and then nothing else (a setting that does not load is reported, not silently replaced); otherwise the
//! lib directories of the NVIDIA Python packages PyTorch installs (nvidia-nccl-cu12/cu13,
//! nvidia-cuda-runtime(-cu12), whose directories `python/` hands over: every directory of the `nvidia`
//! namespace package), then the system's search path (`libnccl.so.2`, `libcudart.so.13`, ...). A failure
//! says every place looked in and what each said. Loading runs no CUDA call that needs a driver:
//! `ncclGetVersion` and `cudaRuntimeGetVersion` answer without one; the device count is asked when
//! reported and carries the driver's error when there is none.

use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use crate::config::GpuConfig;
use crate::gpu::cuda::CudaRuntime;
use crate::gpu::nccl::Nccl;

/// Where a candidate came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Source {
    /// The variable that named it.
    Setting(&'static str),
    /// An NVIDIA Python package's lib directory.
    Package,
    /// A bare file name, searched by the dynamic loader (LD_LIBRARY_PATH, ld.so.cache, ...).
    System,
}

/// One place a library may be.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Candidate {
    pub path: PathBuf,
    pub source: Source,
}

impl fmt::Display for Candidate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let path = self.path.display();
        match self.source {
            Source::Setting(name) => write!(f, "{path} (from {name})"),
            Source::Package => write!(f, "{path} (NVIDIA Python package)"),
            Source::System => write!(f, "{path} (system library path)"),
        }
    }
}

fn candidates(
    setting: Option<(&Path, &'static str)>,
    nvidia_dirs: &[PathBuf],
    in_packages: &[&str],
    system: &[&str],
) -> Vec<Candidate> {
    if let Some((path, name)) = setting {
        return vec![Candidate { path: path.to_path_buf(), source: Source::Setting(name) }];
    }
    let packaged = nvidia_dirs
        .iter()
        .flat_map(|dir| in_packages.iter().map(move |rel| Candidate { path: dir.join(rel), source: Source::Package }));
    let system = system.iter().map(|name| Candidate { path: PathBuf::from(name), source: Source::System });
    packaged.chain(system).collect()
}

/// Where libnccl is looked for, in order. `nvidia_dirs`: the directories of the `nvidia` Python package.
pub fn nccl_candidates(config: &GpuConfig, nvidia_dirs: &[PathBuf]) -> Vec<Candidate> {
    let setting = config.nccl_library.as_deref().map(|p| (p, "RVOD_NCCL_LIBRARY"));
    candidates(setting, nvidia_dirs, &["nccl/lib/libnccl.so.2"], &["libnccl.so.2", "libnccl.so"])
}

/// Where libcudart is looked for, in order (CUDA 13's package layout, then CUDA 12's).
pub fn cuda_candidates(config: &GpuConfig, nvidia_dirs: &[PathBuf]) -> Vec<Candidate> {
    let setting = config.cuda_library.as_deref().map(|p| (p, "RVOD_CUDA_LIBRARY"));
    candidates(
        setting,
        nvidia_dirs,
        &["cu13/lib/libcudart.so.13", "cuda_runtime/lib/libcudart.so.12", "cu12/lib/libcudart.so.12"],
        &["libcudart.so.13", "libcudart.so.12", "libcudart.so"],
    )
}

/// The first candidate that loads, or every candidate with what went wrong.
pub fn open_first(library: &str, candidates: &[Candidate]) -> Result<(libloading::Library, Candidate), String> {
    let mut tried = Vec::new();
    for candidate in candidates {
        if candidate.source != Source::System && !candidate.path.exists() {
            tried.push(format!("{candidate}: no such file"));
            continue;
        }
        // SAFETY: loading runs the library's initialisers; libcudart and libnccl are made to be dlopened.
        match unsafe { libloading::Library::new(&candidate.path) } {
            Ok(lib) => return Ok((lib, candidate.clone())),
            Err(error) => tried.push(format!("{candidate}: {error}")),
        }
    }
    Err(format!("{library} not found; looked for {}", tried.join("; ")))
}

/// The libraries this process loaded (or why not).
pub struct GpuLibraries {
    pub cuda: Result<CudaRuntime, String>,
    pub nccl: Result<Nccl, String>,
}

impl GpuLibraries {
    /// Look for and load both libraries (see the module doc).
    pub fn load(config: &GpuConfig, nvidia_dirs: &[PathBuf]) -> GpuLibraries {
        let cuda = open_first("the CUDA runtime (libcudart)", &cuda_candidates(config, nvidia_dirs))
            .and_then(|(lib, found)| CudaRuntime::new(lib, found.path));
        let nccl = open_first("NCCL (libnccl)", &nccl_candidates(config, nvidia_dirs))
            .and_then(|(lib, found)| Nccl::new(lib, found.path));
        GpuLibraries { cuda, nccl }
    }

    /// Why GPU tensors cannot be used on this machine, or `None` when a driver, a device and NCCL are there.
    pub fn unavailable(&self) -> Option<String> {
        let cuda = match &self.cuda {
            Ok(cuda) => cuda,
            Err(why) => return Some(why.clone()),
        };
        if let Err(why) = cuda.device_count() {
            return Some(why);
        }
        self.nccl.as_ref().err().cloned()
    }
}

/// The function `name` of `lib`, as the function pointer type `T`, or which symbol is missing.
pub(crate) fn symbol<T: Copy>(lib: &libloading::Library, path: &Path, name: &str) -> Result<T, String> {
    let c_name = format!("{name}\0");
    // SAFETY: every caller declares `T` as the C signature the library's header gives `name`.
    let found = unsafe { lib.get::<T>(c_name.as_bytes()) };
    found.map(|f| *f).map_err(|e| format!("{} lacks {name}: {e}", path.display()))
}

static LOADED: OnceLock<GpuLibraries> = OnceLock::new();

/// This process's libraries, loaded by the first call (later calls' arguments are not used).
pub fn libraries(config: &GpuConfig, nvidia_dirs: &[PathBuf]) -> &'static GpuLibraries {
    LOADED.get_or_init(|| GpuLibraries::load(config, nvidia_dirs))
}

/// This process's libraries if they were loaded already (by [`libraries`]), without loading them.
pub fn loaded() -> Option<&'static GpuLibraries> {
    LOADED.get()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn paths(candidates: &[Candidate]) -> Vec<String> {
        candidates.iter().map(|c| c.to_string()).collect()
    }

    #[test]
    fn lookup_order_is_setting_else_packages_then_system() {
        let dirs = [PathBuf::from("/venv/site-packages/nvidia"), PathBuf::from("/user/site-packages/nvidia")];
        assert_eq!(
            paths(&nccl_candidates(&GpuConfig::default(), &dirs)),
            vec![
                "/venv/site-packages/nvidia/nccl/lib/libnccl.so.2 (NVIDIA Python package)",
                "/user/site-packages/nvidia/nccl/lib/libnccl.so.2 (NVIDIA Python package)",
                "libnccl.so.2 (system library path)",
                "libnccl.so (system library path)",
            ]
        );
        assert_eq!(
            paths(&cuda_candidates(&GpuConfig::default(), &dirs[..1])),
            vec![
                "/venv/site-packages/nvidia/cu13/lib/libcudart.so.13 (NVIDIA Python package)",
                "/venv/site-packages/nvidia/cuda_runtime/lib/libcudart.so.12 (NVIDIA Python package)",
                "/venv/site-packages/nvidia/cu12/lib/libcudart.so.12 (NVIDIA Python package)",
                "libcudart.so.13 (system library path)",
                "libcudart.so.12 (system library path)",
                "libcudart.so (system library path)",
            ]
        );
        let set = GpuConfig {
            nccl_library: Some("/opt/nccl/libnccl.so.2".into()),
            cuda_library: Some("/opt/cuda/libcudart.so".into()),
            ..GpuConfig::default()
        };
        assert_eq!(paths(&nccl_candidates(&set, &dirs)), vec!["/opt/nccl/libnccl.so.2 (from RVOD_NCCL_LIBRARY)"]);
        assert_eq!(paths(&cuda_candidates(&set, &dirs)), vec!["/opt/cuda/libcudart.so (from RVOD_CUDA_LIBRARY)"]);
    }

    #[test]
    fn a_library_that_is_not_there_is_reported_with_every_place_looked_in() {
        let dir = std::env::temp_dir().join(format!("rvod-gpu-lookup-{}", std::process::id()));
        std::fs::create_dir_all(dir.join("nccl/lib")).unwrap();
        std::fs::write(dir.join("nccl/lib/libnccl.so.2"), b"not a library").unwrap();
        let candidates = [
            Candidate { path: "/nonexistent/libnccl.so.2".into(), source: Source::Setting("RVOD_NCCL_LIBRARY") },
            Candidate { path: dir.join("nccl/lib/libnccl.so.2"), source: Source::Package },
            Candidate { path: "librvod-no-such-library.so.9".into(), source: Source::System },
        ];
        let error = open_first("NCCL (libnccl)", &candidates).err().unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
        assert!(error.starts_with("NCCL (libnccl) not found; looked for /nonexistent/libnccl.so.2 (from RVOD_NCCL_LIBRARY): no such file; "), "{error}");
        assert!(error.contains("libnccl.so.2 (NVIDIA Python package): "), "{error}");
        assert!(error.contains("librvod-no-such-library.so.9 (system library path): "), "{error}");
        let loaded = GpuLibraries::load(
            &GpuConfig {
                nccl_library: Some("/nonexistent/libnccl.so.2".into()),
                cuda_library: Some("/nonexistent/libcudart.so".into()),
                ..GpuConfig::default()
            },
            &[],
        );
        let why = loaded.unavailable().unwrap();
        assert_eq!(
            why,
            "the CUDA runtime (libcudart) not found; looked for /nonexistent/libcudart.so (from RVOD_CUDA_LIBRARY): no such file"
        );
        assert!(loaded.nccl.err().unwrap().contains("RVOD_NCCL_LIBRARY"));
    }
}
