//! Making the UCP context and worker, with the settings the rank decides rather than the
//! environment.

use std::ffi::CString;

use crate::runtime::transport::ucx::config::EngineConfig;
use crate::runtime::transport::ucx::{check, sys, UcxError};

/// The context and worker, made on the engine thread.
pub(super) fn open(
    ucp: &'static sys::Ucp,
    cfg: &EngineConfig,
) -> Result<(sys::ucp_context_h, sys::ucp_worker_h), UcxError> {
    // SAFETY: every parameter struct is zeroed and its field mask names the fields set.
    unsafe {
        let mut config: *mut sys::ucp_config_t = std::ptr::null_mut();
        check(
            ucp,
            "ucp_config_read",
            (ucp.ucp_config_read)(std::ptr::null(), std::ptr::null(), &mut config),
        )?;
        // The rank decides these, not the user's shell.
        let mut settings = vec![
            ("TLS", cfg.transports.as_str()),
            // Keep shared memory and CMA under peer-failure handling (§4 of UCX.md): without
            // these UCX moves same-host traffic to TCP loopback.
            // (`CMA_MEMORY_INVALIDATE` is a memory-domain setting that this call cannot reach:
            // [`super::library`] sets it in the environment before libucp is loaded.)
            ("MM_ERROR_HANDLING", "y"),
            // Shared memory notices a dead peer only by keepalive, every 20 s by default; the
            // control plane's heartbeats and every collective's deadline stay the authority.
            ("KEEPALIVE_INTERVAL", "1s"),
        ];
        if let Some(devices) = cfg.net_devices.as_deref() {
            settings.push(("NET_DEVICES", devices));
        }
        for (key, value) in settings {
            let (Ok(k), Ok(v)) = (CString::new(key), CString::new(value)) else {
                (ucp.ucp_config_release)(config);
                return Err(UcxError::Call {
                    call: "ucp_config_modify",
                    status: format!("{key}: a NUL byte in `{value}`"),
                });
            };
            let s = (ucp.ucp_config_modify)(config, k.as_ptr(), v.as_ptr());
            if let Err(e) = check(ucp, "ucp_config_modify", s) {
                (ucp.ucp_config_release)(config);
                return Err(UcxError::Call {
                    call: "ucp_config_modify",
                    status: format!("{key}={value}: {e}"),
                });
            }
        }
        let mut params: sys::ucp_params_t = std::mem::zeroed();
        params.field_mask = sys::UCP_PARAM_FIELD_FEATURES as u64;
        params.features = (sys::UCP_FEATURE_AM | sys::UCP_FEATURE_WAKEUP) as u64;
        let mut ctx: sys::ucp_context_h = std::ptr::null_mut();
        let s = (ucp.ucp_init_version)(
            sys::UCP_API_MAJOR,
            sys::UCP_API_MINOR,
            &params,
            config,
            &mut ctx,
        );
        (ucp.ucp_config_release)(config);
        check(ucp, "ucp_init_version", s)?;
        let mut wp: sys::ucp_worker_params_t = std::mem::zeroed();
        wp.field_mask = sys::UCP_WORKER_PARAM_FIELD_THREAD_MODE as u64;
        wp.thread_mode = sys::UCS_THREAD_MODE_SINGLE;
        let mut worker: sys::ucp_worker_h = std::ptr::null_mut();
        if let Err(e) = check(
            ucp,
            "ucp_worker_create",
            (ucp.ucp_worker_create)(ctx, &wp, &mut worker),
        ) {
            (ucp.ucp_cleanup)(ctx);
            return Err(e);
        }
        Ok((ctx, worker))
    }
}

/// The worker's address as bytes.
pub(super) unsafe fn worker_address(
    ucp: &sys::Ucp,
    worker: sys::ucp_worker_h,
) -> Result<Vec<u8>, UcxError> {
    let mut addr: *mut sys::ucp_address_t = std::ptr::null_mut();
    let mut len: sys::size_t = 0;
    check(
        ucp,
        "ucp_worker_get_address",
        (ucp.ucp_worker_get_address)(worker, &mut addr, &mut len),
    )?;
    let out = std::slice::from_raw_parts(addr as *const u8, len as usize).to_vec();
    (ucp.ucp_worker_release_address)(worker, addr);
    Ok(out)
}
