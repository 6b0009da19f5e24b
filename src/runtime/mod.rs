//! The runtime layer: ractor actors, threads and transports that execute what the plan and the
//! engines decide. Nothing above this layer imports it.

pub mod actors;
pub mod alloc;
pub mod clock;
pub mod cluster;
pub mod collectives;
pub mod comm;
pub mod control;
pub mod control_plane;
pub mod coord_actor;
pub mod heartbeat;
pub mod http;
pub mod local;
pub mod net_faults;
pub mod parcel;
mod proc_conn;
pub mod proc_coord;
mod proc_join;
mod proc_standby;
pub mod proc_state;
pub mod proc_worker;
pub mod proxy;
pub mod quic;
mod quic_config;
mod quic_inbox;
mod quic_io;
mod quic_socket;
pub mod rank_actor;
pub mod rank_state;
pub mod replica;
pub mod reshard;
pub mod resume;
pub mod status;
pub mod step;
pub mod tcp;
pub mod transport;

pub use cluster::{train, Cluster, ClusterError, ClusterSpec, TrainOutcome};
pub use control::{ClusterBuilder, ControlError, ControlHandle, ElasticJob};
pub use status::{ChangeRecord, Status};
