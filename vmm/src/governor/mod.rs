//! The memory governor (issue 13): keeps a set of VMs inside one host memory budget.

pub mod policy;
