//! The system calls both sides need, each once: the loop device ioctls (the controller attaches
//! with them, the node reads which file a loop device is bound to), entering a private mount
//! namespace (moorctl's demo and the privileged tests), and a child that dies with its parent
//! (the daemons moorctl's demo and the tests start).

pub mod loopdev;
pub mod mount_namespace;
pub mod parent_death;
