//! The system calls both sides need, each once: the loop device ioctls (the controller attaches
//! with them, the node reads which file a loop device is bound to), entering a private mount
//! namespace (moorctl's demo and the privileged tests), a child that dies with its parent
//! (the daemons moorctl's demo and the tests start), and the filesystem ioctls of the
//! controller's group snapshots and snapshot metadata (`fsctl`: freeze, thaw, FIEMAP), and
//! no core dump of a daemon that holds keys (`core_dumps`).

pub mod core_dumps;
pub mod fsctl;
pub mod loopdev;
pub mod mount_namespace;
pub mod parent_death;
