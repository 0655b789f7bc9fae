//! Which local address a rank's data listeners bind to and advertise.
//!
//! In order: `RVOD_IFACE_ADDR` as given; else the IPv4 address of the NICs named by
//! `RVOD_NETWORK_INTERFACE` (`HOROVOD_GLOO_IFACE`), every one of which must exist; else loopback when the
//! rendezvous address is loopback (a one-host job stays on loopback); else the local address the kernel
//! routes to the rendezvous address from (a connected UDP socket's own address: no packet is sent). The
//! choice and its reason are returned so the caller can log them.

use std::ffi::CStr;
use std::io;
use std::net::{IpAddr, Ipv4Addr, SocketAddr, UdpSocket};

use crate::launched::BindAddress;

/// The address to bind to and a sentence saying why it was chosen; `Err` names what was wrong.
pub fn choose_bind_address(bind: &BindAddress, rendezvous: SocketAddr) -> Result<(IpAddr, String), String> {
    match bind {
        BindAddress::Explicit(addr) => Ok((*addr, format!("{addr}, given by RVOD_IFACE_ADDR"))),
        BindAddress::Interfaces(names) => {
            let nics = interfaces().map_err(|e| format!("cannot list the network interfaces: {e}"))?;
            nic_address(names, &nics)
        }
        BindAddress::Auto if rendezvous.ip().is_loopback() => Ok((
            IpAddr::V4(Ipv4Addr::LOCALHOST),
            format!("127.0.0.1, since the rendezvous address {rendezvous} is loopback"),
        )),
        BindAddress::Auto => {
            let addr = route_to(rendezvous)
                .map_err(|e| format!("no local address routes to the rendezvous address {rendezvous}: {e}"))?;
            Ok((addr, format!("{addr}, the local address that routes to the rendezvous address {rendezvous}")))
        }
    }
}

/// The IPv4 address of the first of `names` that has one; every name must be one of `nics`.
fn nic_address(names: &[String], nics: &[(String, Option<Ipv4Addr>)]) -> Result<(IpAddr, String), String> {
    let mut known: Vec<&str> = Vec::new();
    for (name, _) in nics {
        if !known.contains(&name.as_str()) {
            known.push(name);
        }
    }
    if let Some(missing) = names.iter().find(|n| !known.contains(&n.as_str())) {
        return Err(format!(
            "network interface '{missing}' (RVOD_NETWORK_INTERFACE / HOROVOD_GLOO_IFACE) does not exist on this \
             host; it has {}",
            known.join(", ")
        ));
    }
    for name in names {
        if let Some(addr) = nics.iter().find(|(n, a)| n == name && a.is_some()).and_then(|(_, a)| *a) {
            return Ok((IpAddr::V4(addr), format!("{addr}, the IPv4 address of network interface {name}")));
        }
    }
    Err(format!("network interface(s) {} have no IPv4 address", names.join(", ")))
}

/// Every interface of this host (a name may repeat), with its IPv4 address where the entry has one.
pub fn interfaces() -> io::Result<Vec<(String, Option<Ipv4Addr>)>> {
    let mut head: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: getifaddrs fills `head` with a list we free below with freeifaddrs.
    if unsafe { libc::getifaddrs(&mut head) } != 0 {
        return Err(io::Error::last_os_error());
    }
    let mut found = Vec::new();
    let mut entry = head;
    while !entry.is_null() {
        // SAFETY: `entry` is a node of the list getifaddrs returned, alive until freeifaddrs.
        let ifa = unsafe { &*entry };
        // SAFETY: ifa_name is a NUL-terminated string owned by the list.
        let name = unsafe { CStr::from_ptr(ifa.ifa_name) }.to_string_lossy().into_owned();
        let mut v4 = None;
        // SAFETY: ifa_addr is null or points to a sockaddr whose family says its real type.
        if !ifa.ifa_addr.is_null() && i32::from(unsafe { (*ifa.ifa_addr).sa_family }) == libc::AF_INET {
            // SAFETY: an AF_INET address is a sockaddr_in.
            let sin = unsafe { &*(ifa.ifa_addr as *const libc::sockaddr_in) };
            v4 = Some(Ipv4Addr::from(u32::from_be(sin.sin_addr.s_addr)));
        }
        found.push((name, v4));
        entry = ifa.ifa_next;
    }
    // SAFETY: `head` came from getifaddrs and is freed once.
    unsafe { libc::freeifaddrs(head) };
    Ok(found)
}

/// The local address the kernel would send from to reach `dest` (connecting a UDP socket sends nothing).
fn route_to(dest: SocketAddr) -> io::Result<IpAddr> {
    let any: SocketAddr = if dest.is_ipv4() { "0.0.0.0:0" } else { "[::]:0" }.parse().map_err(io::Error::other)?;
    let socket = UdpSocket::bind(any)?;
    socket.connect(dest)?;
    Ok(socket.local_addr()?.ip())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn nics() -> Vec<(String, Option<Ipv4Addr>)> {
        vec![
            ("lo".into(), None),
            ("lo".into(), Some(Ipv4Addr::LOCALHOST)),
            ("eth0".into(), None),
            ("eth1".into(), Some(Ipv4Addr::new(192, 0, 2, 5))),
        ]
    }

    #[test]
    fn a_named_nic_gives_its_ipv4_address() {
        let (addr, why) = nic_address(&["eth0".into(), "eth1".into()], &nics()).unwrap();
        assert_eq!(addr, IpAddr::V4(Ipv4Addr::new(192, 0, 2, 5)));
        assert!(why.contains("eth1"), "{why}");
        let err = nic_address(&["eth0".into()], &nics()).unwrap_err();
        assert!(err.contains("no IPv4 address"), "{err}");
    }

    #[test]
    fn a_missing_nic_is_named_with_those_there_are() {
        let err = nic_address(&["eth1".into(), "ib9".into()], &nics()).unwrap_err();
        assert!(err.contains("'ib9'") && err.contains("lo, eth0, eth1"), "{err}");
    }

    #[test]
    fn this_host_has_loopback_and_routes_loopback_to_itself() {
        let all = interfaces().unwrap();
        assert!(all.iter().any(|(_, a)| *a == Some(Ipv4Addr::LOCALHOST)), "{all:?}");
        let rdv: SocketAddr = "127.0.0.1:4000".parse().unwrap();
        assert_eq!(choose_bind_address(&BindAddress::Auto, rdv).unwrap().0, IpAddr::V4(Ipv4Addr::LOCALHOST));
        assert_eq!(route_to(rdv).unwrap(), IpAddr::V4(Ipv4Addr::LOCALHOST));
        let lo = all.iter().find(|(_, a)| *a == Some(Ipv4Addr::LOCALHOST)).map(|(n, _)| n.clone()).unwrap();
        let chosen = choose_bind_address(&BindAddress::Interfaces(vec![lo]), rdv).unwrap();
        assert_eq!(chosen.0, IpAddr::V4(Ipv4Addr::LOCALHOST));
    }
}
