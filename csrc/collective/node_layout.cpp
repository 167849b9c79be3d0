#include "collective/node_layout.hpp"

#include <map>
#include <sstream>
#include <stdexcept>

#include "collective/rank_list.hpp"

namespace sdma {

NodeLayout NodeLayout::group(const std::vector<std::string>& nodeOfRank) {
  NodeLayout layout;
  std::map<std::string, int> index;
  for (size_t q = 0; q < nodeOfRank.size(); ++q) {
    auto [it, added] = index.emplace(nodeOfRank[q], static_cast<int>(layout.nodes_.size()));
    if (added) {
      layout.nodes_.emplace_back();
    }
    layout.nodeOf_.push_back(it->second);
    layout.localOf_.push_back(static_cast<int>(layout.nodes_[it->second].size()));
    layout.nodes_[it->second].push_back(static_cast<int>(q));
  }
  return layout;
}

std::vector<int> NodeLayout::rail(int local) const {
  if (nodes_.empty()) {
    throwEmpty("rail");
  }
  std::vector<int> ranks;
  for (int m = 0; m < nodeCount(); ++m) {
    ranks.push_back(rankAt(m, local));  // checked: a smaller node has no member with that local index
  }
  return ranks;
}

namespace {

constexpr const char* kEmptyLayout = "an empty layout: default-constructed, or read after it was moved";

std::string layoutBug(const char* what, const std::string& problem) {
  return std::string("torch_sdma: NodeLayout::") + what + ": " + problem + " (a bug in torch_sdma)";
}

}  // namespace

void NodeLayout::throwBadRank(int rank, const char* what) const {
  throw std::logic_error(layoutBug(what, "group rank " + std::to_string(rank) + " is not in this layout of " +
                                             std::to_string(size()) + " ranks" +
                                             (size() == 0 ? std::string(" (") + kEmptyLayout + ")" : "")));
}

void NodeLayout::throwBadNode(int node, const char* what) const {
  throw std::logic_error(layoutBug(what, "node " + std::to_string(node) + " is not in this layout of " +
                                             std::to_string(nodeCount()) + " nodes" +
                                             (nodeCount() == 0 ? std::string(" (") + kEmptyLayout + ")" : "")));
}

void NodeLayout::throwBadLocal(int node, int local, const char* what) const {
  throw std::logic_error(layoutBug(what, "node " + std::to_string(node) + " has " +
                                             std::to_string(nodes_[node].size()) + " ranks, no local index " +
                                             std::to_string(local)));
}

void NodeLayout::throwEmpty(const char* what) const {
  throw std::logic_error(layoutBug(what, std::string("the layout has no nodes (") + kEmptyLayout + ")"));
}

bool NodeLayout::equalNodeSizes() const {
  for (const auto& n : nodes_) {
    if (n.size() != nodes_.front().size()) {
      return false;
    }
  }
  return true;
}

std::string NodeLayout::hierarchyProblem() const {
  if (nodes_.empty()) {
    return "no members";
  }
  if (!equalNodeSizes()) {
    return "nodes of unequal size";
  }
  if (ranksPerNode() == 1) {
    return "one rank per node";
  }
  return "";
}

std::string NodeLayout::describe() const {
  std::ostringstream os;
  if (nodes_.empty()) {
    return "no members";
  }
  if (!equalNodeSizes()) {
    os << nodeCount() << " nodes of unequal size (";
    for (int m = 0; m < nodeCount(); ++m) {
      os << (m ? "," : "") << rankList(nodes_[m], ",");
    }
    os << ")";
    return os.str();
  }
  const int per = ranksPerNode();
  os << nodeCount() << (nodeCount() == 1 ? " node x " : " nodes x ") << per << (per == 1 ? " rank" : " ranks")
     << " (rails ";
  for (int r = 0; r < per; ++r) {
    os << (r ? "," : "") << rankList(rail(r), ",");
  }
  os << ")";
  return os.str();
}

}  // namespace sdma
