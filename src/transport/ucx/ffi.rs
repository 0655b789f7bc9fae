//! The part of UCP's C API (libucp 1.10 and later) that rvod calls, declared by hand so that nothing is
//! linked and no UCX header is needed to build. Checked against UCX 1.13.1's `ucp/api/ucp.h`,
//! `ucp/api/ucp_def.h` and `ucs/type/status.h` (sizes and offsets: `ucp_params_t` 80 bytes,
//! `ucp_worker_params_t` 200 with `events` at 144, `ucp_ep_params_t` 104 with `name` at 80,
//! `ucp_request_param_t` 72 with `datatype` at 24). UCX reads a parameter struct only where its
//! `field_mask` says a field is set, so the older and newer libraries that end these structs sooner or
//! later read the fields rvod sets the same way. Only functions present since UCX 1.10 are used.

use std::ffi::{c_char, c_int, c_uint, c_void};

/// `ucs_status_t`: a packed enum, one signed byte.
pub type Status = i8;
pub const UCS_OK: Status = 0;
pub const UCS_INPROGRESS: Status = 1;
pub const UCS_ERR_BUSY: Status = -15;
/// Statuses from here down are endpoint failures (a peer that died or became unreachable).
pub const UCS_ERR_FIRST_ENDPOINT_FAILURE: Status = -60;
pub const UCS_ERR_LAST_ENDPOINT_FAILURE: Status = -89;
pub const UCS_ERR_CONNECTION_RESET: Status = -25;
pub const UCS_ERR_UNREACHABLE: Status = -6;
pub const UCS_ERR_CANCELED: Status = -16;
/// `UCS_ERR_LAST`: a returned pointer at or above `(uintptr_t)UCS_ERR_LAST` is an error status.
const UCS_ERR_LAST: isize = -100;

pub type Context = *mut c_void;
pub type Worker = *mut c_void;
pub type Ep = *mut c_void;
/// `ucp_tag_message_h`: a probed message not received yet.
pub type Message = *mut c_void;
/// `ucs_status_ptr_t`: NULL (done), an error status, or a request.
pub type StatusPtr = *mut c_void;

/// `ucp_params_t`.
#[repr(C)]
pub struct Params {
    pub field_mask: u64,
    pub features: u64,
    pub request_size: usize,
    pub request_init: *const c_void,
    pub request_cleanup: *const c_void,
    pub tag_sender_mask: u64,
    pub mt_workers_shared: c_int,
    pub estimated_num_eps: usize,
    pub estimated_num_ppn: usize,
    pub name: *const c_char,
}
pub const UCP_PARAM_FIELD_FEATURES: u64 = 1 << 0;
pub const UCP_FEATURE_TAG: u64 = 1 << 0;
pub const UCP_FEATURE_WAKEUP: u64 = 1 << 4;

/// `ucp_worker_params_t` (`cpu_mask` is `ucs_cpu_set_t`: 1024 bits).
#[repr(C)]
pub struct WorkerParams {
    pub field_mask: u64,
    pub thread_mode: c_uint,
    pub cpu_mask: [u64; 16],
    pub events: c_uint,
    pub user_data: *mut c_void,
    pub event_fd: c_int,
    pub flags: u64,
    pub name: *const c_char,
    pub am_alignment: usize,
    pub client_id: u64,
}
pub const UCP_WORKER_PARAM_FIELD_THREAD_MODE: u64 = 1 << 0;
/// `UCS_THREAD_MODE_SERIALIZED`: any thread may use the worker, one at a time (the transport is `&mut`).
pub const UCS_THREAD_MODE_SERIALIZED: c_uint = 1;

/// `ucp_err_handler_t`.
#[repr(C)]
pub struct ErrHandler {
    pub cb: Option<unsafe extern "C" fn(arg: *mut c_void, ep: Ep, status: Status)>,
    pub arg: *mut c_void,
}

/// `ucs_sock_addr_t`.
#[repr(C)]
pub struct SockAddr {
    pub addr: *const c_void,
    pub addrlen: u32,
}

/// `ucp_ep_params_t`.
#[repr(C)]
pub struct EpParams {
    pub field_mask: u64,
    pub address: *const c_void,
    pub err_mode: c_uint,
    pub err_handler: ErrHandler,
    pub user_data: *mut c_void,
    pub flags: c_uint,
    pub sockaddr: SockAddr,
    pub conn_request: *mut c_void,
    pub name: *const c_char,
    pub local_sockaddr: SockAddr,
}
pub const UCP_EP_PARAM_FIELD_REMOTE_ADDRESS: u64 = 1 << 0;
pub const UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE: u64 = 1 << 1;
pub const UCP_EP_PARAM_FIELD_ERR_HANDLER: u64 = 1 << 2;
/// `UCP_ERR_HANDLING_MODE_NONE`: UCX leaves a peer's failure to the application.
pub const UCP_ERR_HANDLING_MODE_NONE: c_uint = 0;
/// `UCP_ERR_HANDLING_MODE_PEER`: a peer's failure fails its requests instead of hanging them.
pub const UCP_ERR_HANDLING_MODE_PEER: c_uint = 1;

/// `ucp_request_param_t`.
#[repr(C)]
pub struct RequestParam {
    pub op_attr_mask: u32,
    pub flags: u32,
    pub request: *mut c_void,
    pub cb: *const c_void,
    pub datatype: u64,
    pub user_data: *mut c_void,
    pub reply_buffer: *mut c_void,
    pub memory_type: c_uint,
    pub recv_info: *mut c_void,
    pub memh: *mut c_void,
}
pub const UCP_OP_ATTR_FIELD_FLAGS: u32 = 1 << 4;
pub const UCP_EP_CLOSE_FLAG_FORCE: u32 = 1 << 0;

impl RequestParam {
    /// No callback, no flags: the caller checks the returned request (`ucp_request_check_status`).
    pub fn plain() -> RequestParam {
        RequestParam::with_flags(0, 0)
    }

    pub fn with_flags(op_attr_mask: u32, flags: u32) -> RequestParam {
        RequestParam {
            op_attr_mask,
            flags,
            request: std::ptr::null_mut(),
            cb: std::ptr::null(),
            datatype: 0,
            user_data: std::ptr::null_mut(),
            reply_buffer: std::ptr::null_mut(),
            memory_type: 0,
            recv_info: std::ptr::null_mut(),
            memh: std::ptr::null_mut(),
        }
    }
}

/// `ucp_tag_recv_info_t`.
#[repr(C)]
#[derive(Default)]
pub struct TagRecvInfo {
    pub sender_tag: u64,
    pub length: usize,
}

/// What a `ucs_status_ptr_t` holds (`UCS_PTR_IS_ERR`, `UCS_PTR_STATUS`).
pub enum Posted {
    Done,
    Failed(Status),
    Pending(*mut c_void),
}

pub fn posted(ptr: StatusPtr) -> Posted {
    if ptr.is_null() {
        Posted::Done
    } else if ptr as usize >= UCS_ERR_LAST as usize {
        Posted::Failed(ptr as isize as Status)
    } else {
        Posted::Pending(ptr)
    }
}

/// Whether `status` says the peer behind an endpoint failed (rather than this process misusing UCX).
pub fn is_peer_failure(status: Status) -> bool {
    matches!(status, UCS_ERR_CONNECTION_RESET | UCS_ERR_UNREACHABLE | UCS_ERR_CANCELED)
        || (UCS_ERR_LAST_ENDPOINT_FAILURE..=UCS_ERR_FIRST_ENDPOINT_FAILURE).contains(&status)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layouts_match_ucx_1_13() {
        assert_eq!(std::mem::size_of::<Params>(), 80);
        assert_eq!(std::mem::size_of::<WorkerParams>(), 200);
        assert_eq!(std::mem::offset_of!(WorkerParams, events), 144);
        assert_eq!(std::mem::offset_of!(WorkerParams, flags), 168);
        assert_eq!(std::mem::size_of::<EpParams>(), 104);
        assert_eq!(std::mem::offset_of!(EpParams, sockaddr), 56);
        assert_eq!(std::mem::offset_of!(EpParams, name), 80);
        assert_eq!(std::mem::size_of::<RequestParam>(), 72);
        assert_eq!(std::mem::offset_of!(RequestParam, datatype), 24);
        assert_eq!(std::mem::offset_of!(RequestParam, memory_type), 48);
        assert_eq!(std::mem::offset_of!(RequestParam, memh), 64);
    }

    #[test]
    fn status_pointers_are_told_apart() {
        assert!(matches!(posted(std::ptr::null_mut()), Posted::Done));
        assert!(matches!(posted(-25isize as StatusPtr), Posted::Failed(-25)));
        assert!(matches!(posted(-100isize as StatusPtr), Posted::Failed(-100)));
        assert!(matches!(posted(0x1000 as StatusPtr), Posted::Pending(_)));
        assert!(is_peer_failure(-25) && is_peer_failure(-80) && is_peer_failure(-60) && !is_peer_failure(-3));
    }
}
