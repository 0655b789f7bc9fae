//! Finding and loading libucp at run time, once per process, on first use: the path in
//! `RVOD_UCX_LIBRARY` when set (and nothing else: a setting that does not load is reported, not replaced),
//! otherwise `libucp.so.0` through the system's search path. Nothing is linked, so the one wheel imports
//! and runs where UCX is absent. A libucp older than 1.10 (before the `*_nbx` calls) is refused as too old.
//!
//! [`Ucx::resources`] lists the transports and devices UCX reports in this process (after `UCX_TLS`), read
//! from `ucp_context_print_info` of a throwaway context; [`rdma_transports`] picks the RDMA-capable ones.

use std::ffi::{c_char, c_int, c_uint, c_void, CStr};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use super::ffi::{self, Context, Ep, Message, Params, RequestParam, Status, StatusPtr, TagRecvInfo, Worker};

/// Oldest UCX whose API rvod uses (the `*_nbx` family).
pub const MIN_VERSION: (u32, u32) = (1, 10);

/// The libucp functions rvod calls (see [`super::ffi`] for the types).
#[allow(clippy::type_complexity)]
pub struct Api {
    pub get_version: unsafe extern "C" fn(*mut c_uint, *mut c_uint, *mut c_uint),
    pub get_version_string: unsafe extern "C" fn() -> *const c_char,
    pub init_version: unsafe extern "C" fn(c_uint, c_uint, *const Params, *const c_void, *mut Context) -> Status,
    pub config_read: unsafe extern "C" fn(*const c_char, *const c_char, *mut *mut c_void) -> Status,
    pub config_modify: unsafe extern "C" fn(*mut c_void, *const c_char, *const c_char) -> Status,
    pub config_release: unsafe extern "C" fn(*mut c_void),
    pub cleanup: unsafe extern "C" fn(Context),
    pub context_print_info: unsafe extern "C" fn(Context, *mut libc::FILE),
    pub worker_create: unsafe extern "C" fn(Context, *const ffi::WorkerParams, *mut Worker) -> Status,
    pub worker_destroy: unsafe extern "C" fn(Worker),
    pub worker_get_address: unsafe extern "C" fn(Worker, *mut *mut c_void, *mut usize) -> Status,
    pub worker_release_address: unsafe extern "C" fn(Worker, *mut c_void),
    pub worker_progress: unsafe extern "C" fn(Worker) -> c_uint,
    pub worker_get_efd: unsafe extern "C" fn(Worker, *mut c_int) -> Status,
    pub worker_arm: unsafe extern "C" fn(Worker) -> Status,
    pub ep_create: unsafe extern "C" fn(Worker, *const ffi::EpParams, *mut Ep) -> Status,
    pub ep_close_nbx: unsafe extern "C" fn(Ep, *const RequestParam) -> StatusPtr,
    pub tag_send_nbx: unsafe extern "C" fn(Ep, *const c_void, usize, u64, *const RequestParam) -> StatusPtr,
    pub tag_probe_nb: unsafe extern "C" fn(Worker, u64, u64, c_int, *mut TagRecvInfo) -> Message,
    pub tag_msg_recv_nbx: unsafe extern "C" fn(Worker, *mut c_void, usize, Message, *const RequestParam) -> StatusPtr,
    pub request_check_status: unsafe extern "C" fn(*mut c_void) -> Status,
    pub request_cancel: unsafe extern "C" fn(Worker, *mut c_void),
    pub request_free: unsafe extern "C" fn(*mut c_void),
    /// `ucs_status_string`, from libucs (a dependency of libucp, so found through its handle).
    pub status_string: unsafe extern "C" fn(Status) -> *const c_char,
}

/// A loaded libucp.
pub struct Ucx {
    pub api: Api,
    pub path: PathBuf,
    /// `ucp_get_version_string()`, e.g. "1.13.1".
    pub version: String,
    resources: OnceLock<Result<Vec<String>, String>>,
    /// Kept loaded for the process's lifetime: `api` points into it.
    _library: libloading::Library,
}

fn symbol<T: Copy>(lib: &libloading::Library, path: &Path, name: &str) -> Result<T, String> {
    let c_name = format!("{name}\0");
    // SAFETY: every caller declares `T` as the C signature UCX's headers give `name` (see `ffi`).
    let found = unsafe { lib.get::<T>(c_name.as_bytes()) };
    found.map(|f| *f).map_err(|e| format!("{} lacks {name} (older than UCX 1.10?): {e}", path.display()))
}

impl Ucx {
    fn open(path: &Path, from: &str) -> Result<Ucx, String> {
        // SAFETY: loading runs libucp's initialisers; libucp is made to be dlopened (Open MPI does).
        let lib = unsafe { libloading::Library::new(path) }
            .map_err(|e| format!("UCX (libucp) not found; looked for {} ({from}): {e}", path.display()))?;
        let api = Api {
            get_version: symbol(&lib, path, "ucp_get_version")?,
            get_version_string: symbol(&lib, path, "ucp_get_version_string")?,
            init_version: symbol(&lib, path, "ucp_init_version")?,
            config_read: symbol(&lib, path, "ucp_config_read")?,
            config_modify: symbol(&lib, path, "ucp_config_modify")?,
            config_release: symbol(&lib, path, "ucp_config_release")?,
            cleanup: symbol(&lib, path, "ucp_cleanup")?,
            context_print_info: symbol(&lib, path, "ucp_context_print_info")?,
            worker_create: symbol(&lib, path, "ucp_worker_create")?,
            worker_destroy: symbol(&lib, path, "ucp_worker_destroy")?,
            worker_get_address: symbol(&lib, path, "ucp_worker_get_address")?,
            worker_release_address: symbol(&lib, path, "ucp_worker_release_address")?,
            worker_progress: symbol(&lib, path, "ucp_worker_progress")?,
            worker_get_efd: symbol(&lib, path, "ucp_worker_get_efd")?,
            worker_arm: symbol(&lib, path, "ucp_worker_arm")?,
            ep_create: symbol(&lib, path, "ucp_ep_create")?,
            ep_close_nbx: symbol(&lib, path, "ucp_ep_close_nbx")?,
            tag_send_nbx: symbol(&lib, path, "ucp_tag_send_nbx")?,
            tag_probe_nb: symbol(&lib, path, "ucp_tag_probe_nb")?,
            tag_msg_recv_nbx: symbol(&lib, path, "ucp_tag_msg_recv_nbx")?,
            request_check_status: symbol(&lib, path, "ucp_request_check_status")?,
            request_cancel: symbol(&lib, path, "ucp_request_cancel")?,
            request_free: symbol(&lib, path, "ucp_request_free")?,
            status_string: symbol(&lib, path, "ucs_status_string")?,
        };
        let (mut major, mut minor, mut release) = (0, 0, 0);
        // SAFETY: three valid out-pointers; the call only reports compiled-in numbers.
        unsafe { (api.get_version)(&mut major, &mut minor, &mut release) };
        // SAFETY: returns a static NUL-terminated string.
        let version = unsafe { CStr::from_ptr((api.get_version_string)()) }.to_string_lossy().into_owned();
        if (major, minor) < MIN_VERSION {
            return Err(format!(
                "UCX {version} at {} is too old: rvod needs UCX {}.{} or later",
                path.display(),
                MIN_VERSION.0,
                MIN_VERSION.1
            ));
        }
        Ok(Ucx { api, path: path.to_path_buf(), version, resources: OnceLock::new(), _library: lib })
    }

    /// UCX's message for `status`.
    pub fn status_text(&self, status: Status) -> String {
        // SAFETY: ucs_status_string returns a static string for any status value.
        unsafe { CStr::from_ptr((self.api.status_string)(status)) }.to_string_lossy().into_owned()
    }

    /// A UCP context with tag matching and wake-ups: `UCX_*` settings from the environment, then `settings`
    /// (UCX's names without the prefix, e.g. `("RNDV_SCHEME", "put_zcopy")`) over them.
    pub fn new_context(&self, settings: &[(&str, &str)]) -> Result<Context, String> {
        let params = Params {
            field_mask: ffi::UCP_PARAM_FIELD_FEATURES,
            features: ffi::UCP_FEATURE_TAG | ffi::UCP_FEATURE_WAKEUP,
            request_size: 0,
            request_init: std::ptr::null(),
            request_cleanup: std::ptr::null(),
            tag_sender_mask: 0,
            mt_workers_shared: 0,
            estimated_num_eps: 0,
            estimated_num_ppn: 0,
            name: std::ptr::null(),
        };
        let mut config: *mut c_void = std::ptr::null_mut();
        if !settings.is_empty() {
            // SAFETY: null prefix and file (the environment's UCX_ settings), a valid out-pointer.
            let status = unsafe { (self.api.config_read)(std::ptr::null(), std::ptr::null(), &mut config) };
            if status != ffi::UCS_OK {
                return Err(format!("ucp_config_read failed: {}", self.status_text(status)));
            }
            for (name, value) in settings {
                let (c_name, c_value) = (std::ffi::CString::new(*name), std::ffi::CString::new(*value));
                let (Ok(c_name), Ok(c_value)) = (c_name, c_value) else {
                    // SAFETY: the configuration read above, used by nothing else.
                    unsafe { (self.api.config_release)(config) };
                    return Err(format!("UCX setting {name}={value} has a NUL byte"));
                };
                // SAFETY: a live configuration and two NUL-terminated strings.
                let status = unsafe { (self.api.config_modify)(config, c_name.as_ptr(), c_value.as_ptr()) };
                if status != ffi::UCS_OK {
                    // SAFETY: as above.
                    unsafe { (self.api.config_release)(config) };
                    return Err(format!("ucp_config_modify {name}={value} failed: {}", self.status_text(status)));
                }
            }
        }
        let mut context: Context = std::ptr::null_mut();
        // SAFETY: valid params and out-pointer; a null config makes UCX read its settings from the environment.
        let status = unsafe { (self.api.init_version)(MIN_VERSION.0, MIN_VERSION.1, &params, config, &mut context) };
        if !config.is_null() {
            // SAFETY: ucp_init copied what it needs; the configuration is ours to release.
            unsafe { (self.api.config_release)(config) };
        }
        if status != ffi::UCS_OK {
            return Err(format!("ucp_init failed: {}", self.status_text(status)));
        }
        Ok(context)
    }

    /// The transports and devices UCX reports here, as "transport/device" (e.g. "tcp/eth0", "rc_mlx5/mlx5_0:1").
    pub fn resources(&self) -> Result<&[String], String> {
        self.resources.get_or_init(|| self.read_resources()).as_ref().map(Vec::as_slice).map_err(Clone::clone)
    }

    fn read_resources(&self) -> Result<Vec<String>, String> {
        let context = self.new_context(&[])?;
        let printed = print_to_string(|file| {
            // SAFETY: a live context and an open stream.
            unsafe { (self.api.context_print_info)(context, file) }
        });
        // SAFETY: the context was made above and nothing else uses it.
        unsafe { (self.api.cleanup)(context) };
        Ok(parse_resources(&printed?))
    }
}

/// How rvod sets UCX up for the links between hosts, from the transports UCX reports here.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Tuning {
    /// Settings given to UCX over the environment's (see [`Ucx::new_context`]).
    pub settings: Vec<(&'static str, &'static str)>,
    /// Whether endpoints ask UCX to handle a peer's failure (`UCP_ERR_HANDLING_MODE_PEER`).
    pub peer_error_handling: bool,
}

/// A setting rvod gives UCX.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct UcxSetting {
    /// Its name in UCX's environment, without `UCX_`: where the user set it, rvod leaves it alone.
    pub name: &'static str,
    /// Its name as `ucp_config_modify` takes it (a transport's own setting goes without the transport's
    /// prefix: `UCX_TCP_SNDBUF` is `SNDBUF`).
    pub key: &'static str,
    pub value: &'static str,
}

/// The settings rvod gives UCX where it has no RDMA transport (see [`tuned`]).
pub const TCP_SETTINGS: [UcxSetting; 2] = [
    UcxSetting { name: "RNDV_SCHEME", key: "RNDV_SCHEME", value: "put_zcopy" },
    UcxSetting { name: "TCP_SNDBUF", key: "SNDBUF", value: "128k" },
];

/// [`Tuning`] for `resources`. Over RDMA (InfiniBand or RoCE verbs) UCX picks its own protocols and handles
/// peer failures itself. Where it has no RDMA transport (its TCP and shared memory only, as when
/// `RVOD_TRANSPORT=ucx` is forced on Ethernet), [`TCP_SETTINGS`], each left alone where the user set it
/// (`user_set(name)`):
/// - large messages go by put-zcopy rendezvous, straight from the sender's buffer into the receiver's; but
///   UCX's TCP transport (1.13) offers its zero-copy put lane only to endpoints without peer error handling:
///   with it, a single active-message lane copies every rendezvous fragment through UCX's buffers on both
///   sides (64 MiB allreduces between two hosts at 0.73-0.84x rvod's TCP). There endpoints go without UCX's
///   error handling: rvod's own control mesh says when a peer ended or froze, and its operations then end
///   their requests (see the module doc);
/// - a small socket send buffer: UCX sends a rendezvous's control messages (ready-to-receive, the put's
///   acknowledgement, the end) on the socket that carries the data, so each waits behind what the kernel
///   already holds to send, megabytes with its default buffer while both ranks of an exchange send (64 MiB
///   allreduces between 2 x 2 ranks at 10 Gbit/s: 0.88x rvod's TCP with the default, 0.96x with 128k, 0.99x
///   with 64k). The kernel doubles it to 256 KiB, which still fills 10 Gbit/s at round trips up to ~200 us.
pub fn tuned(resources: &[String], user_set: &dyn Fn(&str) -> bool) -> Tuning {
    if !rdma_transports(resources).is_empty() {
        return Tuning { settings: Vec::new(), peer_error_handling: true };
    }
    let settings = TCP_SETTINGS.iter().filter(|s| !user_set(s.name)).map(|s| (s.key, s.value)).collect();
    Tuning { settings, peer_error_handling: false }
}

/// What `print` writes to a C stream, as text.
fn print_to_string(print: impl FnOnce(*mut libc::FILE)) -> Result<String, String> {
    let mut buffer: *mut c_char = std::ptr::null_mut();
    let mut size: libc::size_t = 0;
    // SAFETY: valid out-pointers; the stream owns `buffer` until fclose, after which we copy and free it.
    let file = unsafe { libc::open_memstream(&mut buffer, &mut size) };
    if file.is_null() {
        return Err(format!("open_memstream: {}", std::io::Error::last_os_error()));
    }
    print(file);
    // SAFETY: `file` is the open stream made above; after fclose `buffer` holds `size` bytes plus a NUL.
    unsafe {
        libc::fclose(file);
        let text = if buffer.is_null() {
            String::new()
        } else {
            String::from_utf8_lossy(std::slice::from_raw_parts(buffer.cast::<u8>(), size)).into_owned()
        };
        libc::free(buffer.cast());
        Ok(text)
    }
}

/// The "transport/device" of each `# resource N : md M dev D flags -- tl/dev` line.
pub fn parse_resources(printed: &str) -> Vec<String> {
    printed
        .lines()
        .filter(|line| line.contains("resource"))
        .filter_map(|line| line.split_once("-- ").map(|(_, rest)| rest.trim().to_string()))
        .filter(|resource| resource.contains('/'))
        .collect()
}

/// The resources whose transport moves data by RDMA: InfiniBand / RoCE verbs (rc, dc, ud and their
/// mlx5 variants). TCP (also over IPoIB), shared memory and loopback are not.
pub fn rdma_transports(resources: &[String]) -> Vec<&str> {
    resources
        .iter()
        .map(String::as_str)
        .filter(|resource| {
            let transport = resource.split('/').next().unwrap_or_default();
            ["rc", "dc", "ud"].iter().any(|kind| transport == *kind || transport.starts_with(&format!("{kind}_")))
        })
        .collect()
}

static LOADED: OnceLock<Result<Ucx, String>> = OnceLock::new();

/// This process's libucp, loaded by the first call (later calls' `setting` is not used): `setting` is
/// `RVOD_UCX_LIBRARY`. UCX's own log lines go to stderr, not its default stdout (the training script's
/// output), unless `UCX_LOG_FILE` says otherwise; libucs reads that once, as it is loaded.
pub fn ucx(setting: Option<&Path>) -> Result<&'static Ucx, String> {
    LOADED
        .get_or_init(|| {
            if std::env::var_os("UCX_LOG_FILE").is_none() {
                std::env::set_var("UCX_LOG_FILE", "stderr");
            }
            load(setting)
        })
        .as_ref()
        .map_err(Clone::clone)
}

fn load(setting: Option<&Path>) -> Result<Ucx, String> {
    match setting {
        Some(path) => Ucx::open(path, "from RVOD_UCX_LIBRARY"),
        None => Ucx::open(Path::new("libucp.so.0"), "system library path"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn without_rdma_put_zcopy_rendezvous_and_no_peer_error_handling_in_ucx() {
        let tcp = vec!["tcp/veth0".to_string(), "self/memory".to_string(), "sysv/memory".to_string()];
        let verbs = vec!["tcp/ib0".to_string(), "rc_mlx5/mlx5_0:1".to_string()];
        let over_tcp = tuned(&tcp, &|_| false);
        assert_eq!(over_tcp.settings, vec![("RNDV_SCHEME", "put_zcopy"), ("SNDBUF", "128k")]);
        assert!(!over_tcp.peer_error_handling, "UCX's TCP transport has no zero-copy put with it");
        let users_scheme = tuned(&tcp, &|name| name == "RNDV_SCHEME");
        assert_eq!(users_scheme.settings, vec![("SNDBUF", "128k")], "UCX_RNDV_SCHEME set by the user");
        assert!(!users_scheme.peer_error_handling);
        assert!(tuned(&tcp, &|_| true).settings.is_empty(), "the user set both");
        assert_eq!(TCP_SETTINGS.map(|s| s.name), crate::config::UCX_TUNED_SETTINGS, "config reads what is tuned");
        let over_rdma = tuned(&verbs, &|_| false);
        assert!(over_rdma.settings.is_empty(), "UCX picks its own scheme over RDMA");
        assert!(over_rdma.peer_error_handling, "UCX handles peer failures over RDMA");
    }

    #[test]
    fn resources_are_read_from_ucxs_printout_and_rdma_ones_picked() {
        let printed = "#\n# UCP context\n#     component 0  :  self\n#            md 1  :  component 1  tcp \n\
                       #      resource 0  :  md 0  dev 0  flags -- self/memory0\n\
                       #      resource 1  :  md 1  dev 1  flags -- tcp/ib0\n\
                       #      resource 2  :  md 2  dev 2  flags -- rc_mlx5/mlx5_0:1\n\
                       #      resource 3  :  md 2  dev 2  flags -- ud_verbs/mlx5_0:1\n\
                       #      resource 4  :  md 3  dev 3  flags -- posix/memory\n#\n";
        let resources = parse_resources(printed);
        assert_eq!(resources, ["self/memory0", "tcp/ib0", "rc_mlx5/mlx5_0:1", "ud_verbs/mlx5_0:1", "posix/memory"]);
        assert_eq!(rdma_transports(&resources), ["rc_mlx5/mlx5_0:1", "ud_verbs/mlx5_0:1"]);
        assert!(rdma_transports(&["tcp/eth0".to_string(), "cma/memory".to_string()]).is_empty());
    }

    /// A stand-in libucp that has every function rvod looks up but says it is UCX 1.9.0, built with `cc`
    /// (`None`, with the reason printed, where there is no C compiler).
    fn old_libucp() -> Option<PathBuf> {
        let dir = std::env::temp_dir().join(format!("rvod-old-libucp-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let names = "ucp_init_version ucp_config_read ucp_config_modify ucp_config_release ucp_cleanup ucp_context_print_info ucp_worker_create ucp_worker_destroy \
                     ucp_worker_get_address ucp_worker_release_address ucp_worker_progress ucp_worker_get_efd \
                     ucp_worker_arm ucp_ep_create ucp_ep_close_nbx ucp_tag_send_nbx ucp_tag_probe_nb \
                     ucp_tag_msg_recv_nbx ucp_request_check_status ucp_request_cancel ucp_request_free \
                     ucs_status_string";
        let mut source = String::from(
            "void ucp_get_version(unsigned *major, unsigned *minor, unsigned *release) \
             { *major = 1; *minor = 9; *release = 0; }\n\
             const char *ucp_get_version_string(void) { return \"1.9.0\"; }\n",
        );
        for name in names.split_whitespace() {
            source.push_str(&format!("void {name}(void) {{}}\n"));
        }
        std::fs::write(dir.join("old_libucp.c"), source).unwrap();
        let library = dir.join("old-libucp.so");
        let built = std::process::Command::new("cc")
            .args(["-shared", "-fPIC", "-o"])
            .arg(&library)
            .arg(dir.join("old_libucp.c"))
            .status();
        match built {
            Ok(status) if status.success() => Some(library),
            other => {
                eprintln!("skipped: could not build a stand-in libucp with cc: {other:?}");
                None
            }
        }
    }

    #[test]
    fn a_libucp_older_than_1_10_is_refused_as_too_old() {
        let Some(library) = old_libucp() else { return };
        let error = Ucx::open(&library, "from RVOD_UCX_LIBRARY").err().unwrap();
        assert_eq!(error, format!("UCX 1.9.0 at {} is too old: rvod needs UCX 1.10 or later", library.display()));
        std::fs::remove_dir_all(library.parent().unwrap()).unwrap();
    }

    #[test]
    fn a_setting_that_does_not_load_is_reported() {
        let error = Ucx::open(Path::new("/nonexistent/libucp.so.0"), "from RVOD_UCX_LIBRARY").err().unwrap();
        assert!(
            error.starts_with("UCX (libucp) not found; looked for /nonexistent/libucp.so.0 (from RVOD_UCX_LIBRARY): ")
        );
    }
}
