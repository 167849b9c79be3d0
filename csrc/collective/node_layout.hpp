// Which members of a group share a node, and the rails across nodes (docs/multinode.md). A node is the set of members
// that publish the same node identity: their host, or a pseudo-node of one host in tests. Every member builds the
// layout from the same exchanged identities with the same rule, so it is the same on every member without a further
// exchange.
#pragma once

#include <string>
#include <vector>

namespace sdma {

class NodeLayout {
 public:
  NodeLayout() = default;
  // `nodeOfRank[q]`: the node identity group rank q published. Nodes are numbered by their lowest group rank; a
  // node's members (its local indices) are in group rank order.
  static NodeLayout group(const std::vector<std::string>& nodeOfRank);

  int size() const {
    return static_cast<int>(nodeOf_.size());
  }
  int nodeCount() const {
    return static_cast<int>(nodes_.size());
  }
  // The accessors below check their argument and throw std::logic_error naming the call rather than read out of
  // bounds: a layout that is empty (default-constructed, or moved from) or asked about a rank, node or local index it
  // does not hold is a bug in the caller, and an unchecked read there is a SIGSEGV with no message (as when the
  // hierarchical copy-engine runner read its HierarchicalSetup's layout after moving the setup away: every rank
  // crashed in its first all-gather). A compare per call, next to what the schedule does per chunk.
  int nodeOf(int rank) const {
    return nodeOf_[checkedRank(rank, "nodeOf")];
  }
  int localIndexOf(int rank) const {
    return localOf_[checkedRank(rank, "localIndexOf")];
  }
  // The group rank with local index `local` on node `node`.
  int rankAt(int node, int local) const {
    const std::vector<int>& members = nodes_[checkedNode(node, "rankAt")];
    if (local < 0 || local >= static_cast<int>(members.size())) {
      throwBadLocal(node, local, "rankAt");
    }
    return members[local];
  }
  const std::vector<int>& node(int node) const {
    return nodes_[checkedNode(node, "node")];
  }
  // Rail `local`: the rank with that local index on every node, in node order (a rank's rail rank is its node).
  std::vector<int> rail(int local) const;
  // Ranks per node, when every node has as many.
  int ranksPerNode() const {
    if (nodes_.empty()) {
      throwEmpty("ranksPerNode");
    }
    return static_cast<int>(nodes_.front().size());
  }

  // "" when the hierarchical schedule takes this layout of several nodes, else why not: it needs nodes of one size
  // (a rail has a member on every node) with more than one rank (else there is nothing to fan out inside a node).
  std::string hierarchyProblem() const;
  // "2 nodes x 2 ranks (rails [0,2],[1,3])", or the nodes themselves where they differ in size.
  std::string describe() const;

 private:
  bool equalNodeSizes() const;
  int checkedRank(int rank, const char* what) const {
    if (rank < 0 || rank >= size()) {
      throwBadRank(rank, what);
    }
    return rank;
  }
  int checkedNode(int node, const char* what) const {
    if (node < 0 || node >= nodeCount()) {
      throwBadNode(node, what);
    }
    return node;
  }
  [[noreturn]] void throwBadRank(int rank, const char* what) const;
  [[noreturn]] void throwBadNode(int node, const char* what) const;
  [[noreturn]] void throwBadLocal(int node, int local, const char* what) const;
  [[noreturn]] void throwEmpty(const char* what) const;

  std::vector<std::vector<int>> nodes_;
  std::vector<int> nodeOf_;
  std::vector<int> localOf_;
};

}  // namespace sdma
