// Shared by csrc/autograd/<op>_autograd.cpp whose backward is a hand-written autograd node, as torch's
// generated ones are (a Node subclass holding SavedVariables, attached by the op's Autograd kernel),
// rather than a torch::autograd::Function, whose apply/backward wrappers cost ~1 us more per forward and
// per backward (benchmarks/host_cost.py).
#pragma once

#include <torch/csrc/autograd/function.h>

#include <memory>
#include <type_traits>
#include <utility>

namespace accel {
namespace node_detail {

// deleteNode(node) through argument-dependent lookup (torch::autograd, the namespace of Node): named only
// where the installed torch has it.
template <typename N>
void delete_node(N* node) {
  deleteNode(node);
}

}  // namespace node_detail

// A new node, held the way the installed torch holds its own: std::shared_ptr with torch's deleteNode
// (which frees long chains of nodes without deep recursion) in torch 2.9, c10::intrusive_ptr in torch
// 2.13. Told apart by what Node::getptr returns, not by version number.
template <typename N>
auto make_node() {
  using Ptr = decltype(std::declval<torch::autograd::Node&>().getptr());
  if constexpr (std::is_same_v<Ptr, std::shared_ptr<torch::autograd::Node>>) {
    return std::shared_ptr<N>(new N(), [](N* node) { node_detail::delete_node(node); });
  } else {
    return c10::make_intrusive<N>();
  }
}

}  // namespace accel
